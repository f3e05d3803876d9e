"""API keys -> organizations, and the admin token.

Secrets are never stored: a key is looked up by its SHA-256 hash and the stored hash is compared
in constant time. Lookups are cached briefly; a revocation through this replica drops the entry
at once, other replicas see it within auth.cache_ttl_s.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from aiohttp import web

from services.gateway.errors import ApiError
from services.gateway.store import ApiKey, Organization, Store


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return "sk-llm-" + secrets.token_urlsafe(32)


def hint_of(secret: str) -> str:
    """A recognisable hint of a key that reveals at most half of it (short tokens reveal nothing)."""
    if len(secret) < 14:
        return "***"
    return f"{secret[:3]}...{secret[-4:]}"


@dataclass(frozen=True)
class Principal:
    organization: Organization
    key: ApiKey


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class Authenticator:
    def __init__(self, store: Store, admin_token: str, cache_ttl_s: float):
        self._store = store
        self._admin_hash = hash_key(admin_token) if admin_token else None
        self._ttl = cache_ttl_s
        self._cache: dict[str, tuple[float, Principal | None]] = {}

    async def principal(self, request: web.Request) -> Principal:
        """The caller's key and organization, or a 401 ApiError."""
        token = bearer_token(request)
        if token is None:
            raise ApiError(401, "missing API key: send Authorization: Bearer <key>", code="invalid_api_key")
        digest = hash_key(token)
        principal = await self._lookup(digest)
        if principal is None:
            raise ApiError(401, f"incorrect API key provided: {hint_of(token)}", code="invalid_api_key")
        return principal

    async def _lookup(self, digest: str) -> Principal | None:
        cached = self._cache.get(digest)
        if cached and cached[0] > time.monotonic():
            return cached[1]
        principal = None
        key = await self._store.find_key(digest)
        if key is not None and key.revoked_at_ms is None and hmac.compare_digest(key.key_hash, digest):
            org = await self._store.get_organization(key.organization_id)
            principal = Principal(org, key) if org else None
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[digest] = (time.monotonic() + self._ttl, principal)
        return principal

    def forget(self, key_hash: str) -> None:
        self._cache.pop(key_hash, None)

    def require_admin(self, request: web.Request) -> None:
        token = bearer_token(request)
        if token is None:
            raise ApiError(401, "missing admin token: send Authorization: Bearer <admin token>",
                           code="invalid_api_key")
        if self._admin_hash is None or not hmac.compare_digest(hash_key(token), self._admin_hash):
            raise ApiError(403, "this endpoint needs the admin token", code="forbidden")

"""The store's records and its one implementation over a small SQL database interface.

SQL is written once with `?` placeholders in the subset SQLite and Postgres share; a Database
adapter runs it (Postgres rewrites the placeholders). API keys are kept only as SHA-256 hashes.
"""

from __future__ import annotations

import secrets
import time
from abc import ABC, abstractmethod
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any


def now_ms() -> int:
    return int(time.time() * 1000)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


@dataclass(frozen=True)
class Organization:
    id: str
    name: str
    rpm_limit: int        # 0 = unlimited
    tpm_limit: int
    created_at_ms: int
    weight: float = 1.0   # its share of a contended model against other organizations'


PRIORITY_CLASSES = {"interactive": 0, "batch": 1}   # a key's class -> priority (lower goes first)


@dataclass(frozen=True)
class ApiKey:
    id: str
    organization_id: str
    name: str
    key_hash: str
    hint: str             # e.g. "sk-...f3a9", safe to show
    rpm_limit: int | None # None = only the organization's limit applies
    tpm_limit: int | None
    created_at_ms: int
    revoked_at_ms: int | None = None
    priority_class: str = "interactive"   # one of PRIORITY_CLASSES

    @property
    def priority(self) -> int:
        return PRIORITY_CLASSES.get(self.priority_class, 0)


@dataclass(frozen=True)
class UsageRecord:
    request_id: str
    organization_id: str
    key_id: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    latency_ms: int
    status: str           # ok | error | cancelled | content_filter | rejected
    created_at_ms: int


@dataclass(frozen=True)
class UsageSummary:
    key_id: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Database(ABC):
    """What the store needs from a SQL driver."""

    @abstractmethod
    async def execute(self, sql: str, *args: Any) -> int:
        """Runs a statement; returns the number of rows changed."""

    @abstractmethod
    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]: ...

    @abstractmethod
    def exclusive(self) -> AbstractAsyncContextManager["Database"]:
        """A transaction no other gateway replica runs at the same time (for migrations)."""

    @abstractmethod
    async def close(self) -> None: ...


class Store:
    def __init__(self, db: Database):
        self.db = db

    async def close(self) -> None:
        await self.db.close()

    # Organizations
    async def create_organization(self, name: str, rpm_limit: int = 0, tpm_limit: int = 0,
                                  weight: float = 1.0) -> Organization:
        org = Organization(new_id("org"), name, rpm_limit, tpm_limit, now_ms(), weight)
        await self.db.execute(
            "INSERT INTO organizations (id, name, rpm_limit, tpm_limit, created_at_ms, weight) VALUES (?, ?, ?, ?, ?, ?)",
            org.id, org.name, org.rpm_limit, org.tpm_limit, org.created_at_ms, org.weight)
        return org

    async def set_organization_weight(self, org_id: str, weight: float) -> bool:
        """False when no such organization."""
        return await self.db.execute("UPDATE organizations SET weight = ? WHERE id = ?", weight, org_id) > 0

    async def get_organization(self, org_id: str) -> Organization | None:
        rows = await self.db.fetch("SELECT * FROM organizations WHERE id = ?", org_id)
        return Organization(**rows[0]) if rows else None

    async def find_organization_by_name(self, name: str) -> Organization | None:
        rows = await self.db.fetch("SELECT * FROM organizations WHERE name = ? ORDER BY created_at_ms", name)
        return Organization(**rows[0]) if rows else None

    async def list_organizations(self) -> list[Organization]:
        rows = await self.db.fetch("SELECT * FROM organizations ORDER BY created_at_ms, id")
        return [Organization(**r) for r in rows]

    # Keys
    async def create_key(self, org_id: str, name: str, key_hash: str, hint: str,
                         rpm_limit: int | None = None, tpm_limit: int | None = None,
                         priority_class: str = "interactive") -> ApiKey:
        key = ApiKey(new_id("key"), org_id, name, key_hash, hint, rpm_limit, tpm_limit, now_ms(),
                     priority_class=priority_class)
        await self.db.execute(
            "INSERT INTO api_keys (id, organization_id, name, key_hash, hint, rpm_limit, tpm_limit, created_at_ms,"
            " priority_class) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            key.id, key.organization_id, key.name, key.key_hash, key.hint, key.rpm_limit, key.tpm_limit,
            key.created_at_ms, key.priority_class)
        return key

    async def find_key(self, key_hash: str) -> ApiKey | None:
        rows = await self.db.fetch("SELECT * FROM api_keys WHERE key_hash = ?", key_hash)
        return ApiKey(**rows[0]) if rows else None

    async def get_key(self, key_id: str) -> ApiKey | None:
        rows = await self.db.fetch("SELECT * FROM api_keys WHERE id = ?", key_id)
        return ApiKey(**rows[0]) if rows else None

    async def list_keys(self, org_id: str) -> list[ApiKey]:
        rows = await self.db.fetch(
            "SELECT * FROM api_keys WHERE organization_id = ? ORDER BY created_at_ms, id", org_id)
        return [ApiKey(**r) for r in rows]

    async def revoke_key(self, key_id: str) -> bool:
        """False when no such key, or already revoked."""
        changed = await self.db.execute(
            "UPDATE api_keys SET revoked_at_ms = ? WHERE id = ? AND revoked_at_ms IS NULL", now_ms(), key_id)
        return changed > 0

    # Usage
    async def record_usage(self, r: UsageRecord) -> None:
        await self.db.execute(
            "INSERT INTO usage_records (request_id, organization_id, key_id, model, prompt_tokens,"
            " completion_tokens, cached_tokens, latency_ms, status, created_at_ms)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            r.request_id, r.organization_id, r.key_id, r.model, r.prompt_tokens, r.completion_tokens,
            r.cached_tokens, r.latency_ms, r.status, r.created_at_ms)

    async def list_usage(self, org_id: str) -> list[UsageRecord]:
        rows = await self.db.fetch(
            "SELECT * FROM usage_records WHERE organization_id = ? ORDER BY created_at_ms, request_id", org_id)
        return [UsageRecord(**r) for r in rows]

    async def usage_summary(self, org_id: str, since_ms: int = 0) -> list[UsageSummary]:
        rows = await self.db.fetch(
            "SELECT key_id, model, COUNT(*) AS requests, SUM(prompt_tokens) AS prompt_tokens,"
            " SUM(completion_tokens) AS completion_tokens, SUM(cached_tokens) AS cached_tokens"
            " FROM usage_records WHERE organization_id = ? AND created_at_ms >= ?"
            " GROUP BY key_id, model ORDER BY key_id, model", org_id, since_ms)
        return [UsageSummary(**{k: (int(v) if k not in ("key_id", "model") else v) for k, v in r.items()})
                for r in rows]

"""Admin API behind the admin bearer token: organizations (with their fair-share weight), their
keys (the secret is shown once, only its hash is kept; each with a priority class), revocation,
usage per key and model, and the router's workers."""

from __future__ import annotations

import math
from dataclasses import asdict

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from services.gateway.app import GATEWAY, Gateway
from services.gateway.auth import hash_key, hint_of, new_secret
from services.gateway.errors import ApiError, invalid
from services.gateway.routes import read_json
from services.gateway.store import ApiKey, Organization
from services.gateway.store.base import PRIORITY_CLASSES

MAX_LIMIT = 1 << 40
MAX_WEIGHT = 1000.0   # the worker's bound too (tenant_weight)


def org_object(org: Organization) -> dict:
    return {"object": "organization", **asdict(org)}


def key_object(key: ApiKey) -> dict:
    body = {"object": "api_key", **asdict(key)}
    del body["key_hash"]
    return body


def _admin(request: web.Request) -> Gateway:
    gw = request.app[GATEWAY]
    gw.auth.require_admin(request)
    return gw


async def _object_body(request: web.Request, allowed: set[str]) -> dict:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(f"unrecognized argument: {unknown[0]}", unknown[0], "unknown_parameter")
    return body


def _name(body: dict) -> str:
    name = body.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise invalid("name is required: a non-empty string of at most 200 characters", "name",
                      "missing_required_parameter" if name is None else "invalid_value")
    return name.strip()


def _limit(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LIMIT:
        raise invalid(f"{name} must be a non-negative integer (0 = unlimited)", name, "invalid_value")
    return value


def _weight(body: dict) -> float | None:
    value = body.get("weight")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_WEIGHT:
        raise invalid(f"weight must be a number in (0, {MAX_WEIGHT:g}] (1 = an equal share)", "weight",
                      "invalid_value")
    return float(value)


def _priority_class(body: dict) -> str:
    value = body.get("priority_class", "interactive")
    if value not in PRIORITY_CLASSES:
        raise invalid(f"priority_class must be one of {sorted(PRIORITY_CLASSES)}", "priority_class",
                      "invalid_value")
    return value


async def _organization(gw: Gateway, org_id: str) -> Organization:
    org = await gw.store.get_organization(org_id)
    if org is None:
        raise ApiError(404, f"no organization `{org_id}`", code="organization_not_found")
    return org


async def create_organization(request: web.Request) -> web.Response:
    gw = _admin(request)
    body = await _object_body(request, {"name", "rpm_limit", "tpm_limit", "weight"})
    org = await gw.store.create_organization(_name(body), _limit(body, "rpm_limit") or 0,
                                             _limit(body, "tpm_limit") or 0, _weight(body) or 1.0)
    return web.json_response(org_object(org), status=201)


async def update_organization(request: web.Request) -> web.Response:
    """PATCH {"weight": w}: the organization's share of a contended model (its keys' lookups, cached
    for auth.cache_ttl_s, see it after that)."""
    gw = _admin(request)
    org = await _organization(gw, request.match_info["id"])
    body = await _object_body(request, {"weight"})
    weight = _weight(body)
    if weight is None:
        raise invalid("weight is required", "weight", "missing_required_parameter")
    await gw.store.set_organization_weight(org.id, weight)
    return web.json_response(org_object(await _organization(gw, org.id)))


async def list_organizations(request: web.Request) -> web.Response:
    gw = _admin(request)
    return web.json_response({"object": "list", "data": [org_object(o) for o in await gw.store.list_organizations()]})


async def get_organization(request: web.Request) -> web.Response:
    gw = _admin(request)
    org = await _organization(gw, request.match_info["id"])
    keys = await gw.store.list_keys(org.id)
    return web.json_response({**org_object(org), "keys": [key_object(k) for k in keys]})


async def create_key(request: web.Request) -> web.Response:
    gw = _admin(request)
    org = await _organization(gw, request.match_info["id"])
    body = await _object_body(request, {"name", "rpm_limit", "tpm_limit", "priority_class"})
    secret = new_secret()
    key = await gw.store.create_key(org.id, _name(body), hash_key(secret), hint_of(secret),
                                    _limit(body, "rpm_limit"), _limit(body, "tpm_limit"), _priority_class(body))
    return web.json_response({**key_object(key), "key": secret}, status=201)


async def list_keys(request: web.Request) -> web.Response:
    gw = _admin(request)
    org = await _organization(gw, request.match_info["id"])
    return web.json_response({"object": "list", "data": [key_object(k) for k in await gw.store.list_keys(org.id)]})


async def revoke_key(request: web.Request) -> web.Response:
    gw = _admin(request)
    key = await gw.store.get_key(request.match_info["id"])
    if key is None or not await gw.store.revoke_key(key.id):
        raise ApiError(404, f"no active key `{request.match_info['id']}`", code="key_not_found")
    gw.auth.forget(key.key_hash)
    return web.json_response({"id": key.id, "object": "api_key.deleted", "revoked": True})


async def usage(request: web.Request) -> web.Response:
    gw = _admin(request)
    org = await _organization(gw, request.match_info["id"])
    since = request.query.get("since", "0")
    if not since.isdigit():
        raise invalid("since must be a unix time in seconds", "since", "invalid_value")
    rows = await gw.store.usage_summary(org.id, int(since) * 1000)
    return web.json_response({"object": "list", "organization_id": org.id,
                              "data": [{"object": "usage", **asdict(r)} for r in rows]})


async def workers(request: web.Request) -> web.Response:
    gw = _admin(request)
    found = await gw.upstream.list_workers(request.query.get("model", ""))
    return web.json_response({"object": "list", "data": [
        MessageToDict(w, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        for w in found]})


def register(app: web.Application) -> None:
    r = app.router
    r.add_post("/admin/v1/organizations", create_organization)
    r.add_get("/admin/v1/organizations", list_organizations)
    r.add_get("/admin/v1/organizations/{id}", get_organization)
    r.add_patch("/admin/v1/organizations/{id}", update_organization)
    r.add_post("/admin/v1/organizations/{id}/keys", create_key)
    r.add_get("/admin/v1/organizations/{id}/keys", list_keys)
    r.add_get("/admin/v1/organizations/{id}/usage", usage)
    r.add_delete("/admin/v1/keys/{id}", revoke_key)
    r.add_get("/admin/v1/workers", workers)

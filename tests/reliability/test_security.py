"""Keys, tenants and secrets on the real platform (two gateway processes sharing one database).

- keys are stored only as SHA-256 hashes and compared with hmac.compare_digest;
- a revoked key is refused at once by the replica that revoked it, and by every other replica
  once its auth cache entry expires (auth.cache_ttl_s, AUTH_CACHE_TTL_S here);
- the admin API refuses API keys; one organization cannot read, list, delete or resume another's
  conversations, nor see its usage;
- no secret (API key, admin token) appears in any process's log or in an error message.
"""

from __future__ import annotations

import hashlib
import hmac
import sqlite3
import time

import httpx
import pytest

from services.gateway import auth as gateway_auth
from services.gateway.auth import Authenticator, hash_key
from services.gateway.store import open_store
from tests.reliability.clients import Admin, api, chat_body
from tests.reliability.platform import ADMIN_TOKEN, AUTH_CACHE_TTL_S


@pytest.fixture(scope="module")
def tenants(platform):
    """Two organizations with one key each: (org id, key id, secret) x 2."""
    admin = Admin(platform.gateway_url)
    return admin.new_org("tenant-a"), admin.new_org("tenant-b")


def database_text(path) -> str:
    with sqlite3.connect(path) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return "\n".join(repr(row) for t in tables for row in db.execute(f'SELECT * FROM "{t}"'))


def test_keys_are_stored_only_as_hashes(platform, tenants):
    dump = database_text(platform.database_path)
    for _, _, secret in tenants:
        assert secret not in dump and secret[7:] not in dump     # not even without its prefix
        assert hashlib.sha256(secret.encode()).hexdigest() in dump
    assert ADMIN_TOKEN not in dump


async def test_key_and_admin_token_comparisons_are_constant_time(tmp_path, monkeypatch):
    compared = []
    compare_digest = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(gateway_auth.hmac, "compare_digest", spy)
    store = await open_store(f"sqlite:///{tmp_path / 'auth.db'}")
    try:
        org = await store.create_organization("ct")
        await store.create_key(org.id, "k", hash_key("sk-constant-time"), "sk-...time")
        authenticator = Authenticator(store, ADMIN_TOKEN, cache_ttl_s=0)
        found = await authenticator._lookup(hash_key("sk-constant-time"))
        assert found is not None and found.organization.id == org.id
        assert compared == [(hash_key("sk-constant-time"),) * 2]

        class Request:
            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        authenticator.require_admin(Request())
        assert compared[-1] == (hash_key(ADMIN_TOKEN),) * 2
    finally:
        await store.close()


def test_a_revoked_key_is_refused_by_every_replica(platform):
    admin = Admin(platform.gateway_url)
    _, key_id, secret = admin.new_org("revoked")
    replicas = [api(g.address, secret) for g in platform.gateways]
    for client in replicas:   # both replicas now hold the key in their auth cache
        assert client.get("/v1/models").status_code == 200
    assert admin.revoke(key_id).status_code == 200
    revoked_at = time.monotonic()
    assert replicas[0].get("/v1/models").status_code == 401        # the revoking replica: at once
    refused_after = None
    while time.monotonic() - revoked_at < AUTH_CACHE_TTL_S + 5:   # the other: within its cache TTL
        if replicas[1].get("/v1/models").status_code == 401:
            refused_after = time.monotonic() - revoked_at
            break
        time.sleep(0.05)
    assert refused_after is not None, "the other replica still accepts the revoked key"
    # After the TTL no replica ever accepts it again.
    time.sleep(max(0.0, AUTH_CACHE_TTL_S - refused_after))
    assert [c.get("/v1/models").status_code for c in replicas] == [401, 401]


def test_the_admin_api_refuses_api_keys(platform, tenants):
    (org_a, _, secret_a), _ = tenants
    client = api(platform.gateway_url, secret_a)
    for method, path in [("GET", "/admin/v1/organizations"), ("GET", f"/admin/v1/organizations/{org_a}"),
                         ("GET", f"/admin/v1/organizations/{org_a}/usage"),
                         ("POST", f"/admin/v1/organizations/{org_a}/keys"), ("GET", "/admin/v1/workers")]:
        r = client.request(method, path, json={"name": "x"} if method == "POST" else None)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", (method, path, r.text)
    with httpx.Client(base_url=platform.gateway_url, timeout=30) as anonymous:
        assert anonymous.get("/admin/v1/organizations").status_code == 401


def test_one_organization_cannot_touch_anothers_conversations(platform, tenants):
    (_, _, secret_a), (_, _, secret_b) = tenants
    a, b = api(platform.gateway_url, secret_a), api(platform.gateway_url, secret_b)
    created = a.post("/v1/conversations", json={"title": "private"})
    assert created.status_code == 201, created.text
    cid = created.json()["id"]
    assert a.post("/v1/chat/completions", json={**chat_body("My secret plan is X.", 2), "conversation_id": cid}
                  ).status_code == 200
    before = a.get(f"/v1/conversations/{cid}").json()

    assert b.get(f"/v1/conversations/{cid}").status_code == 404
    assert cid not in [c["id"] for c in b.get("/v1/conversations", params={"limit": 100}).json()["data"]]
    assert b.delete(f"/v1/conversations/{cid}").status_code == 404
    resumed = b.post("/v1/chat/completions", json={**chat_body("What was my plan?", 2), "conversation_id": cid})
    assert resumed.status_code == 404 and resumed.json()["error"]["code"] == "conversation_not_found"

    after = a.get(f"/v1/conversations/{cid}").json()
    assert after == before and after["message_count"] == 2    # untouched by the other tenant


def test_usage_is_admin_only(platform, tenants):
    (org_a, _, _), (_, _, secret_b) = tenants
    assert api(platform.gateway_url, secret_b).get(f"/admin/v1/organizations/{org_a}/usage").status_code == 403
    usage = Admin(platform.gateway_url).http.get(f"/admin/v1/organizations/{org_a}/usage")
    assert usage.status_code == 200 and usage.json()["organization_id"] == org_a


def test_secrets_never_appear_in_logs_or_error_messages(platform, tenants):
    (_, _, secret_a), _ = tenants
    client = api(platform.gateway_url, secret_a)
    assert client.post("/v1/chat/completions", json=chat_body("Hello", 2)).status_code == 200
    wrong = secret_a[:-1] + ("x" if secret_a[-1] != "x" else "y")
    refused = api(platform.gateway_url, wrong).get("/v1/models")
    assert refused.status_code == 401 and wrong not in refused.text and wrong[7:-4] not in refused.text
    admin_refused = api(platform.gateway_url, ADMIN_TOKEN + "z").get("/admin/v1/organizations")
    assert admin_refused.status_code == 403 and ADMIN_TOKEN not in admin_refused.text
    logs = platform.logs()
    assert len(logs) > 1000   # the logs were captured
    for secret in (secret_a, wrong, ADMIN_TOKEN, *(t[2] for t in tenants)):
        assert secret not in logs and secret[7:-4] not in logs

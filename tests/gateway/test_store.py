"""The organizations / keys / usage store: the same tests against SQLite and a real Postgres
(a database of its own per run, dropped after)."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import asyncpg
import pytest

from services.gateway.store import UsageRecord, open_store
from services.gateway.store.base import now_ms
from services.gateway.store.migrations import MIGRATIONS

PG_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


@pytest.fixture(scope="module")
def postgres_url():
    name = f"gateway_test_{secrets.token_hex(6)}"

    async def admin(sql: str) -> None:
        try:
            conn = await asyncpg.connect(PG_ADMIN_DSN, timeout=5)
        except (OSError, asyncpg.PostgresError) as e:
            pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_DSN}: {e}", pytrace=False)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f"CREATE DATABASE {name}"))
    yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    asyncio.run(admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'gateway.db'}"
    return request.getfixturevalue("postgres_url")


def usage(org: str, key: str, model: str, prompt: int, completion: int, status: str = "ok") -> UsageRecord:
    return UsageRecord(request_id=secrets.token_hex(4), organization_id=org, key_id=key, model=model,
                       prompt_tokens=prompt, completion_tokens=completion, cached_tokens=1, latency_ms=5,
                       status=status, created_at_ms=now_ms())


async def test_organizations_keys_and_revocation(store_url):
    store = await open_store(store_url)
    try:
        org = await store.create_organization(f"acme-{secrets.token_hex(3)}", rpm_limit=10, tpm_limit=1000)
        assert await store.get_organization(org.id) == org
        assert org in await store.list_organizations()
        assert await store.get_organization("org_missing") is None
        key = await store.create_key(org.id, "ci", "h" * 64, "sk-...abcd", rpm_limit=5)
        assert await store.find_key("h" * 64) == key and key.tpm_limit is None and key.rpm_limit == 5
        assert await store.list_keys(org.id) == [key]
        assert await store.revoke_key(key.id) is True
        assert (await store.find_key("h" * 64)).revoked_at_ms is not None
        assert await store.revoke_key(key.id) is False           # already revoked
        assert await store.revoke_key("key_missing") is False
    finally:
        await store.close()


async def test_usage_summary_per_key_and_model(store_url):
    store = await open_store(store_url)
    try:
        org = await store.create_organization("usage")
        for record in (usage(org.id, "k1", "m1", 10, 5), usage(org.id, "k1", "m1", 20, 7),
                       usage(org.id, "k1", "m2", 1, 1), usage(org.id, "k2", "m1", 3, 0, "cancelled"),
                       usage("org_other", "k9", "m1", 100, 100)):
            await store.record_usage(record)
        rows = [(r.key_id, r.model, r.requests, r.prompt_tokens, r.completion_tokens, r.cached_tokens)
                for r in await store.usage_summary(org.id)]
        assert rows == [("k1", "m1", 2, 30, 12, 2), ("k1", "m2", 1, 1, 1, 1), ("k2", "m1", 1, 3, 0, 1)]
        assert await store.usage_summary(org.id, since_ms=now_ms() + 60_000) == []
        assert [u.status for u in await store.list_usage(org.id)].count("cancelled") == 1
    finally:
        await store.close()


async def test_migrations_are_applied_once_and_recorded(store_url):
    first = await open_store(store_url)
    second = await open_store(store_url)   # a second replica starting: nothing applied twice
    try:
        rows = await second.db.fetch("SELECT version FROM schema_migrations ORDER BY version")
        assert [r["version"] for r in rows] == [v for v, _ in MIGRATIONS]
    finally:
        await first.close()
        await second.close()


async def test_bad_database_url():
    from llmserve.config import ConfigError
    with pytest.raises(ConfigError, match="database.url"):
        await open_store("mysql://nope")

"""Versioned schema migrations, applied in order at start under an exclusive lock.

Append new versions; never edit an applied one. Portable SQL only (SQLite and Postgres).
"""

from __future__ import annotations

from services.gateway.store.base import Database, now_ms

MIGRATIONS: list[tuple[int, list[str]]] = [
    (1, [
        """CREATE TABLE organizations (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            rpm_limit BIGINT NOT NULL DEFAULT 0,
            tpm_limit BIGINT NOT NULL DEFAULT 0,
            created_at_ms BIGINT NOT NULL)""",
        """CREATE TABLE api_keys (
            id TEXT PRIMARY KEY,
            organization_id TEXT NOT NULL REFERENCES organizations(id),
            name TEXT NOT NULL,
            key_hash TEXT NOT NULL UNIQUE,
            hint TEXT NOT NULL,
            rpm_limit BIGINT,
            tpm_limit BIGINT,
            created_at_ms BIGINT NOT NULL,
            revoked_at_ms BIGINT)""",
        "CREATE INDEX api_keys_org ON api_keys (organization_id)",
        """CREATE TABLE usage_records (
            request_id TEXT NOT NULL,
            organization_id TEXT NOT NULL,
            key_id TEXT NOT NULL,
            model TEXT NOT NULL,
            prompt_tokens BIGINT NOT NULL,
            completion_tokens BIGINT NOT NULL,
            cached_tokens BIGINT NOT NULL,
            latency_ms BIGINT NOT NULL,
            status TEXT NOT NULL,
            created_at_ms BIGINT NOT NULL)""",
        "CREATE INDEX usage_records_org_time ON usage_records (organization_id, created_at_ms)",
    ]),
    (2, [   # fair shares: an organization's weight, a key's priority class
        "ALTER TABLE organizations ADD COLUMN weight DOUBLE PRECISION NOT NULL DEFAULT 1",
        "ALTER TABLE api_keys ADD COLUMN priority_class TEXT NOT NULL DEFAULT 'interactive'",
    ]),
]


async def migrate(db: Database) -> int:
    """Applies the missing versions; returns the schema version now in place."""
    async with db.exclusive() as tx:
        await tx.execute("CREATE TABLE IF NOT EXISTS schema_migrations ("
                         "version INTEGER PRIMARY KEY, applied_at_ms BIGINT NOT NULL)")
        rows = await tx.fetch("SELECT MAX(version) AS v FROM schema_migrations")
        current = rows[0]["v"] or 0
        for version, statements in MIGRATIONS:
            if version <= current:
                continue
            for sql in statements:
                await tx.execute(sql)
            await tx.execute("INSERT INTO schema_migrations (version, applied_at_ms) VALUES (?, ?)",
                             version, now_ms())
            current = version
        return current

"""PostgreSQL through an asyncpg pool. SQL arrives with `?` placeholders and is rewritten to $n."""

from __future__ import annotations

import re
from contextlib import asynccontextmanager
from functools import lru_cache
from typing import Any, AsyncIterator

import asyncpg

from services.gateway.store.base import Database

_MIGRATION_LOCK_KEY = 0x6C6C6D67  # "llmg": one advisory lock shared by every gateway replica


@lru_cache(maxsize=256)
def _numbered(sql: str) -> str:
    count = iter(range(1, 10_000))
    return re.sub(r"\?", lambda _: f"${next(count)}", sql)


def _rowcount(status: str) -> int:
    last = status.rsplit(" ", 1)[-1]
    return int(last) if last.isdigit() else 0


class _Connection(Database):
    def __init__(self, conn: asyncpg.Connection):
        self._conn = conn

    async def execute(self, sql: str, *args: Any) -> int:
        return _rowcount(await self._conn.execute(_numbered(sql), *args))

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        return [dict(r) for r in await self._conn.fetch(_numbered(sql), *args)]

    def exclusive(self):
        raise NotImplementedError("already inside a transaction")

    async def close(self) -> None:
        pass


class PostgresDatabase(Database):
    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

    @classmethod
    async def open(cls, dsn: str) -> "PostgresDatabase":
        return cls(await asyncpg.create_pool(dsn, min_size=1, max_size=10))

    async def execute(self, sql: str, *args: Any) -> int:
        return _rowcount(await self._pool.execute(_numbered(sql), *args))

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        return [dict(r) for r in await self._pool.fetch(_numbered(sql), *args)]

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[Database]:
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK_KEY)
            yield _Connection(conn)

    async def close(self) -> None:
        await self._pool.close()

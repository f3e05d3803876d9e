"""PostgreSQL through an asyncpg connection pool.

Transactions run at READ COMMITTED; an append locks its conversation row (SELECT ... FOR UPDATE),
so appends to one conversation run one after another while other conversations proceed. Reads
that take several queries use a REPEATABLE READ snapshot so a conversation and its messages agree.
"""

from __future__ import annotations

import functools
import itertools
import re
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import asyncpg

from .sql import Row, SqlStore


@functools.lru_cache(maxsize=256)
def _numbered(sql: str) -> str:
    """`?` placeholders as Postgres' $1, $2, ...; our queries hold no literal question marks."""
    counter = itertools.count(1)
    return re.sub(r"\?", lambda _: f"${next(counter)}", sql)


class _PostgresTransaction:
    def __init__(self, conn: asyncpg.Connection):
        self._conn = conn

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        return await self._conn.fetch(_numbered(sql), *args)

    async def execute(self, sql: str, *args: Any) -> None:
        await self._conn.execute(_numbered(sql), *args)

    async def executemany(self, sql: str, rows: list[tuple]) -> None:
        await self._conn.executemany(_numbered(sql), rows)

    async def execute_script(self, sql: str) -> None:
        await self._conn.execute(sql)   # without arguments asyncpg runs several statements


class PostgresStore(SqlStore):
    dialect = "postgres"
    lock_for_update = " FOR UPDATE"
    # Two services starting at once must not both create the tables.
    migrations_lock = "SELECT pg_advisory_xact_lock(hashtext('llmserve.conversations.migrations'))"

    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

    @classmethod
    async def open(cls, url: str, min_size: int = 1, max_size: int = 10) -> PostgresStore:
        return cls(await asyncpg.create_pool(url, min_size=min_size, max_size=max_size))

    @asynccontextmanager
    async def transaction(self, write: bool) -> AsyncIterator[_PostgresTransaction]:
        isolation = "read_committed" if write else "repeatable_read"
        async with self._pool.acquire() as conn, conn.transaction(isolation=isolation, readonly=not write):
            yield _PostgresTransaction(conn)

    async def close(self) -> None:
        await self._pool.close()

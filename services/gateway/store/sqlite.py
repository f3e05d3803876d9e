"""SQLite through aiosqlite: the embedded default. One connection in autocommit mode."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import aiosqlite
from llmserve.sqlite import connect_sqlite

from services.gateway.store.base import Database


class SqliteDatabase(Database):
    def __init__(self, conn: aiosqlite.Connection):
        self._conn = conn
        self._exclusive = asyncio.Lock()

    @classmethod
    async def open(cls, path: str) -> "SqliteDatabase":
        # synchronous=NORMAL: no fsync per usage record; a power cut may lose the last few.
        return cls(await connect_sqlite(path, pragmas=("synchronous = NORMAL", "foreign_keys = ON"), busy_timeout_ms=5000))

    async def execute(self, sql: str, *args: Any) -> int:
        async with self._conn.execute(sql, args) as cur:
            return cur.rowcount

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        async with self._conn.execute(sql, args) as cur:
            return [dict(row) for row in await cur.fetchall()]

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[Database]:
        async with self._exclusive:
            await self._conn.execute("BEGIN IMMEDIATE")  # also locks out other processes
            try:
                yield self
            except BaseException:
                await self._conn.execute("ROLLBACK")
                raise
            await self._conn.execute("COMMIT")

    async def close(self) -> None:
        await self._conn.close()

"""SQLite through aiosqlite: the embedded default. One connection in autocommit mode."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import aiosqlite

from services.gateway.store.base import Database


class SqliteDatabase(Database):
    def __init__(self, conn: aiosqlite.Connection):
        self._conn = conn
        self._exclusive = asyncio.Lock()

    @classmethod
    async def open(cls, path: str) -> "SqliteDatabase":
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        conn = await aiosqlite.connect(path, isolation_level=None)
        conn.row_factory = aiosqlite.Row
        # WAL + synchronous=NORMAL: no fsync per usage record; a power cut may lose the last few.
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON", "busy_timeout=5000"):
            await conn.execute(f"PRAGMA {pragma}")
        return cls(conn)

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

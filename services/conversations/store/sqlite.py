"""SQLite through aiosqlite: the embedded default, one file, no server.

One connection, used by one coroutine at a time (an asyncio lock), so transactions never
interleave inside the process. Write transactions start with BEGIN IMMEDIATE, taking the database
write lock up front: another process on the same file waits (busy_timeout) instead of failing at
its first write, and an append's read-then-insert is never raced.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import aiosqlite
from llmserve.sqlite import connect_sqlite

from .sql import Row, SqlStore


class _SqliteTransaction:
    def __init__(self, db: aiosqlite.Connection):
        self._db = db

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        async with self._db.execute(sql, args) as cursor:
            return list(await cursor.fetchall())

    async def execute(self, sql: str, *args: Any) -> None:
        await self._db.execute(sql, args)

    async def executemany(self, sql: str, rows: list[tuple]) -> None:
        await self._db.executemany(sql, rows)

    async def execute_script(self, sql: str) -> None:
        # executescript() would COMMIT the open transaction first; run statement by statement.
        for statement in _statements(sql):
            await self._db.execute(statement)


class SqliteStore(SqlStore):
    dialect = "sqlite"

    def __init__(self, db: aiosqlite.Connection):
        self._db = db
        self._lock = asyncio.Lock()

    @classmethod
    async def open(cls, path: str, busy_timeout_ms: int = 10_000) -> SqliteStore:
        db = await connect_sqlite(
            path,
            pragmas=("synchronous = FULL",    # a committed append survives power loss too
                     "foreign_keys = ON"),    # messages and appends cascade on delete
            busy_timeout_ms=busy_timeout_ms,
        )
        return cls(db)

    @asynccontextmanager
    async def transaction(self, write: bool) -> AsyncIterator[_SqliteTransaction]:
        async with self._lock:
            try:
                await self._db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                yield _SqliteTransaction(self._db)
                await self._db.execute("COMMIT")
            except BaseException:
                # Statements run in order on aiosqlite's thread even when their caller was
                # cancelled, so this ROLLBACK follows a cancelled BEGIN or COMMIT; after a
                # COMMIT that did run there is nothing to roll back.
                with contextlib.suppress(sqlite3.OperationalError):
                    await self._db.execute("ROLLBACK")
                raise

    async def close(self) -> None:
        await self._db.close()


def _statements(script: str) -> list[str]:
    statements, pending = [], ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            statements.append(pending.strip())
            pending = ""
    if pending.strip():
        statements.append(pending.strip())
    return statements

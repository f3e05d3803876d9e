"""Opening an SQLite file that several processes share (the embedded stores' one way in).

Invariants: the connection is in WAL mode with a busy timeout before it is handed out; every
pragma's cursor is read to the end and closed (an unread `PRAGMA journal_mode` result keeps its
statement open and so the file read-locked); and a connection that fails to open is closed
(aiosqlite runs it on a non-daemon thread: one left open keeps the interpreter from exiting).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import aiosqlite


async def connect_sqlite(path: str, pragmas: tuple[str, ...] = (), busy_timeout_ms: int = 10_000) -> aiosqlite.Connection:
    """An autocommit connection (callers issue BEGIN/COMMIT themselves) with rows by name."""
    if path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    conn = await aiosqlite.connect(path, isolation_level=None, timeout=busy_timeout_ms / 1000)
    try:
        conn.row_factory = aiosqlite.Row
        await _pragma(conn, f"busy_timeout = {int(busy_timeout_ms)}")
        await _enable_wal(conn, deadline=time.monotonic() + busy_timeout_ms / 1000)
        for pragma in pragmas:
            await _pragma(conn, pragma)
    except BaseException:
        await conn.close()
        raise
    return conn


async def _pragma(conn: aiosqlite.Connection, pragma: str) -> None:
    async with conn.execute(f"PRAGMA {pragma}") as cursor:
        await cursor.fetchall()


async def _enable_wal(conn: aiosqlite.Connection, deadline: float) -> None:
    # Switching a new file to WAL takes it to itself, and SQLite asks for that lock without its
    # busy handler: while any other connection (another process starting) holds a read lock it
    # answers "database is locked" at once. So the switch is retried here until the timeout. A
    # file already in WAL mode needs no switch.
    delay = 0.005
    while True:
        try:
            return await _pragma(conn, "journal_mode = WAL")
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() + delay > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(2 * delay, 0.1)

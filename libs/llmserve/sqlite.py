"""Opening an SQLite file that several processes share (the embedded stores' one way in).

Invariants: the connection is in WAL mode with a busy timeout before it is handed out; every
pragma's cursor is read to the end and closed (an unread `PRAGMA journal_mode` result keeps its
statement open and so the file read-locked, which made concurrent opens fail with "database is
locked"); and a connection that fails to open is closed (aiosqlite runs it on a non-daemon thread:
one left open keeps the interpreter from ever exiting).
"""

from __future__ import annotations

from pathlib import Path

import aiosqlite


async def connect_sqlite(path: str, pragmas: tuple[str, ...] = (), busy_timeout_ms: int = 10_000) -> aiosqlite.Connection:
    """An autocommit connection (callers issue BEGIN/COMMIT themselves) with rows by name."""
    if path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    conn = await aiosqlite.connect(path, isolation_level=None, timeout=busy_timeout_ms / 1000)
    try:
        conn.row_factory = aiosqlite.Row
        for pragma in (f"busy_timeout = {int(busy_timeout_ms)}", "journal_mode = WAL", *pragmas):
            async with conn.execute(f"PRAGMA {pragma}") as cursor:
                await cursor.fetchall()
    except BaseException:
        await conn.close()
        raise
    return conn

"""libs/llmserve/sqlite.py: opening a file another process holds waits for it, and a failed open
leaves no connection thread behind (one would keep the interpreter from exiting)."""

import asyncio
import sqlite3
import threading

import pytest

from llmserve.sqlite import connect_sqlite


def _hold_exclusive(path) -> sqlite3.Connection:
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE IF NOT EXISTS t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    return holder


async def test_open_waits_while_another_connection_holds_the_file(tmp_path):
    path = tmp_path / "held.db"
    holder = _hold_exclusive(path)
    asyncio.get_running_loop().call_later(0.3, holder.execute, "COMMIT")
    conn = await connect_sqlite(str(path), busy_timeout_ms=5000)
    try:
        async with conn.execute("PRAGMA journal_mode") as cur:
            assert (await cur.fetchone())[0] == "wal"
    finally:
        await conn.close()
        holder.close()


async def test_open_that_times_out_raises_and_closes_its_connection(tmp_path):
    path = tmp_path / "held.db"
    holder = _hold_exclusive(path)
    before = set(threading.enumerate())
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            await connect_sqlite(str(path), busy_timeout_ms=200)
    finally:
        holder.close()
    await asyncio.sleep(0.05)
    assert [t for t in threading.enumerate() if t not in before and t.is_alive()] == []


async def test_concurrent_opens_of_a_new_file_all_succeed(tmp_path):
    path = str(tmp_path / "new.db")
    opened = await asyncio.gather(*(connect_sqlite(path) for _ in range(6)), return_exceptions=True)
    for conn in opened:
        if not isinstance(conn, BaseException):
            await conn.close()
    assert [c for c in opened if isinstance(c, BaseException)] == []

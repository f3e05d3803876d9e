"""Opens the store a database URL names and brings its schema up to date."""

from __future__ import annotations

from llmserve.config import ConfigError
from services.gateway.store.base import Store
from services.gateway.store.migrations import migrate


async def open_store(url: str) -> Store:
    if url.startswith("sqlite://"):
        from services.gateway.store.sqlite import SqliteDatabase
        path = url[len("sqlite://"):]
        db = await SqliteDatabase.open(path[1:] if path.startswith("/") else path)
    elif url.startswith(("postgresql://", "postgres://")):
        from services.gateway.store.postgres import PostgresDatabase
        db = await PostgresDatabase.open(url)
    else:
        raise ConfigError(f"database.url: expected sqlite:///path or postgresql://..., got {url!r}")
    try:
        await migrate(db)
    except BaseException:
        await db.close()
        raise
    return Store(db)

"""Conversation stores: SQLite (embedded default) and Postgres, chosen by the database URL."""

from __future__ import annotations

from ..config import StoreConfig
from .base import (Conversation, ConversationChange, ConversationNotFound, ConversationStore, Cursor,
                   Message, NewMessage, ROLES, KINDS)

__all__ = ["Conversation", "ConversationChange", "ConversationNotFound", "ConversationStore", "Cursor", "Message",
           "NewMessage", "ROLES", "KINDS", "open_store"]


async def open_store(config: StoreConfig) -> ConversationStore:
    """Connects to the store the URL names and applies pending migrations."""
    scheme, sep, rest = config.url.partition("://")
    if scheme == "sqlite" and sep and rest.startswith("/"):
        from .sqlite import SqliteStore
        # sqlite:///var/a.db is the relative path var/a.db, sqlite:////var/a.db the absolute /var/a.db
        store: ConversationStore = await SqliteStore.open(rest[1:])
    elif scheme in ("postgresql", "postgres") and sep:
        from .postgres import PostgresStore
        store = await PostgresStore.open(config.url, config.pool_min_size, config.pool_max_size)
    else:
        raise ValueError(f"store url must be sqlite:///path or postgresql://..., got {config.url!r}")
    try:
        await store.migrate()
    except BaseException:
        await store.close()
        raise
    return store

"""The conversation queries, written once for both dialects.

Queries use `?` placeholders and SQL that SQLite and Postgres both accept (row values, RETURNING).
A dialect supplies transactions, the clause that row-locks a conversation, and how it runs a
multi-statement script.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from contextlib import AbstractAsyncContextManager
from typing import Any, Mapping, Protocol

from .. import migrations
from .base import (Conversation, ConversationChange, ConversationNotFound, ConversationStore, Cursor,
                   Message, NewMessage, new_id, now_ms)

Row = Mapping[str, Any]

_CONVERSATION_COLUMNS = ("id, organization_id, title, model, metadata, created_at_ms, updated_at_ms, "
                         "message_count, kind")
_MESSAGE_COLUMNS = "id, seq, role, content, partial, model, created_at_ms"
# Every table is prefixed so the service can share a database with others (the gateway has its
# own schema_migrations).
_MIGRATIONS_TABLE = "conversations_schema_migrations"


class Transaction(Protocol):
    async def fetch(self, sql: str, *args: Any) -> list[Row]: ...
    async def execute(self, sql: str, *args: Any) -> None: ...
    async def executemany(self, sql: str, rows: list[tuple]) -> None: ...
    async def execute_script(self, sql: str) -> None: ...


class SqlStore(ConversationStore):
    dialect: str                 # names the migrations folder
    lock_for_update = ""         # appended to the SELECT that starts an append
    migrations_lock = ""         # statement that serialises concurrent migrators, if needed

    @abc.abstractmethod
    def transaction(self, write: bool) -> AbstractAsyncContextManager[Transaction]:
        """A transaction. Writes to one conversation must run one at a time: SQLite's write
        transactions take the database lock at BEGIN, Postgres' lock the row (lock_for_update)."""

    async def create(self, organization_id: str, title: str, model: str,
                     metadata: dict[str, str], kind: str = "") -> Conversation:
        now = now_ms()
        conversation = Conversation(new_id(), organization_id, title, model, dict(metadata), now, now, 0, kind=kind)
        async with self.transaction(write=True) as tx:
            await tx.execute(
                f"INSERT INTO conversations ({_CONVERSATION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?)",
                conversation.id, organization_id, title, model, json.dumps(metadata), now, now, kind)
        return conversation

    async def get(self, organization_id: str, conversation_id: str) -> Conversation:
        async with self.transaction(write=False) as tx:
            rows = await tx.fetch(
                f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE id = ? AND organization_id = ?",
                conversation_id, organization_id)
            if not rows:
                raise ConversationNotFound(conversation_id)
            messages = await tx.fetch(
                f"SELECT {_MESSAGE_COLUMNS} FROM conversation_messages WHERE conversation_id = ? ORDER BY seq",
                conversation_id)
        return _conversation(rows[0], [_message(m) for m in messages])

    async def list(self, organization_id: str, limit: int,
                   after: Cursor | None = None, kind: str = "") -> list[Conversation]:
        where, args = "organization_id = ? AND kind = ?", [organization_id, kind]
        if after is not None:
            where += " AND (updated_at_ms, id) < (?, ?)"
            args += [after.updated_at_ms, after.id]
        async with self.transaction(write=False) as tx:
            rows = await tx.fetch(
                f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE {where} "
                "ORDER BY updated_at_ms DESC, id DESC LIMIT ?", *args, limit)
        return [_conversation(row) for row in rows]

    async def append(self, organization_id: str, conversation_id: str, messages: list[NewMessage],
                     idempotency_key: str) -> list[Message]:
        async with self.transaction(write=True) as tx:
            # The row lock serialises appends to one conversation: seqs stay contiguous and a
            # concurrent retry sees the first call's conversation_appends row once it gets the lock.
            rows = await tx.fetch(
                "SELECT message_count, updated_at_ms FROM conversations "
                f"WHERE id = ? AND organization_id = ?{self.lock_for_update}",
                conversation_id, organization_id)
            if not rows:
                raise ConversationNotFound(conversation_id)
            first_seq, updated_at_ms = rows[0]["message_count"], rows[0]["updated_at_ms"]
            previous = await tx.fetch(
                "SELECT first_seq, count FROM conversation_appends "
                "WHERE conversation_id = ? AND idempotency_key = ?", conversation_id, idempotency_key)
            if previous:
                start, count = previous[0]["first_seq"], previous[0]["count"]
                stored = await tx.fetch(
                    f"SELECT {_MESSAGE_COLUMNS} FROM conversation_messages "
                    "WHERE conversation_id = ? AND seq >= ? AND seq < ? ORDER BY seq",
                    conversation_id, start, start + count)
                return [_message(m) for m in stored]
            # updated_at never moves backwards, so list order follows append order even if the clock does.
            now = max(now_ms(), updated_at_ms)
            stored = [Message(new_id(), first_seq + i, m.role, m.content, m.partial, m.model, now)
                      for i, m in enumerate(messages)]
            await tx.executemany(
                f"INSERT INTO conversation_messages (conversation_id, {_MESSAGE_COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(conversation_id, m.id, m.seq, m.role, m.content, m.partial, m.model, m.created_at_ms)
                 for m in stored])
            await tx.execute(
                "INSERT INTO conversation_appends (conversation_id, idempotency_key, first_seq, count) "
                "VALUES (?, ?, ?, ?)",
                conversation_id, idempotency_key, first_seq, len(stored))
            await tx.execute(
                "UPDATE conversations SET message_count = ?, updated_at_ms = ? WHERE id = ?",
                first_seq + len(stored), now, conversation_id)
        return stored

    async def update(self, organization_id: str, conversation_id: str, change: ConversationChange) -> Conversation:
        async with self.transaction(write=True) as tx:
            rows = await tx.fetch(
                f"SELECT {_CONVERSATION_COLUMNS} FROM conversations "
                f"WHERE id = ? AND organization_id = ?{self.lock_for_update}",
                conversation_id, organization_id)
            if not rows:
                raise ConversationNotFound(conversation_id)
            old = _conversation(rows[0])
            count, updated_at_ms = old.message_count, old.updated_at_ms
            if change.keep_messages is not None and change.keep_messages < count:
                count, updated_at_ms = change.keep_messages, max(now_ms(), updated_at_ms)
                await tx.execute("DELETE FROM conversation_messages WHERE conversation_id = ? AND seq >= ?",
                                 conversation_id, count)
                # A replayed key must not answer with messages that are gone or were replaced.
                await tx.execute("DELETE FROM conversation_appends WHERE conversation_id = ? AND first_seq + count > ?",
                                 conversation_id, count)
            new = dataclasses.replace(
                old, title=_or(change.title, old.title), model=_or(change.model, old.model),
                metadata=dict(_or(change.metadata, old.metadata)), updated_at_ms=updated_at_ms, message_count=count)
            await tx.execute(
                "UPDATE conversations SET title = ?, model = ?, metadata = ?, message_count = ?, updated_at_ms = ? "
                "WHERE id = ?", new.title, new.model, json.dumps(new.metadata), count, updated_at_ms, conversation_id)
        return new

    async def delete(self, organization_id: str, conversation_id: str) -> None:
        async with self.transaction(write=True) as tx:
            deleted = await tx.fetch(
                "DELETE FROM conversations WHERE id = ? AND organization_id = ? RETURNING id",
                conversation_id, organization_id)
        if not deleted:
            raise ConversationNotFound(conversation_id)

    async def migrate(self) -> list[int]:
        async with self.transaction(write=True) as tx:
            if self.migrations_lock:
                await tx.execute(self.migrations_lock)
            await tx.execute(f"CREATE TABLE IF NOT EXISTS {_MIGRATIONS_TABLE} (version INTEGER PRIMARY KEY, "
                             "name TEXT NOT NULL, applied_at_ms BIGINT NOT NULL)")
            applied = {r["version"] for r in await tx.fetch(f"SELECT version FROM {_MIGRATIONS_TABLE}")}
            todo = migrations.pending(self.dialect, applied)
            for migration in todo:
                await tx.execute_script(migration.sql)
                await tx.execute(f"INSERT INTO {_MIGRATIONS_TABLE} (version, name, applied_at_ms) "
                                 "VALUES (?, ?, ?)", migration.version, migration.name, now_ms())
        return [m.version for m in todo]


def _or(value, default):
    return default if value is None else value


def _conversation(row: Row, messages: list[Message] | None = None) -> Conversation:
    return Conversation(
        id=str(row["id"]), organization_id=row["organization_id"], title=row["title"],
        model=row["model"], metadata=json.loads(row["metadata"]), created_at_ms=row["created_at_ms"],
        updated_at_ms=row["updated_at_ms"], message_count=row["message_count"], messages=messages or [],
        kind=row["kind"])


def _message(row: Row) -> Message:
    return Message(id=str(row["id"]), seq=row["seq"], role=row["role"], content=row["content"],
                   partial=bool(row["partial"]), model=row["model"], created_at_ms=row["created_at_ms"])

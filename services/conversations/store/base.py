"""The store interface: what the servicer needs from a database, in plain dataclasses.

Every method takes the organization id and matches it in the same query as the conversation id,
so a conversation of another organization is indistinguishable from one that does not exist.
Inputs are already validated by the servicer; the stores trust them.
"""

from __future__ import annotations

import abc
import time
import uuid
from dataclasses import dataclass, field


ROLES = ("system", "user", "assistant", "tool")
KINDS = ("", "response")   # a chat conversation, a stored /v1/responses response


class ConversationNotFound(LookupError):
    """No conversation with this id in this organization."""


@dataclass(frozen=True)
class NewMessage:
    role: str
    content: str
    partial: bool = False
    model: str = ""


@dataclass(frozen=True)
class Message:
    id: str
    seq: int                     # position in the conversation, contiguous from 0
    role: str
    content: str
    partial: bool
    model: str
    created_at_ms: int


@dataclass(frozen=True)
class Conversation:
    id: str
    organization_id: str
    title: str
    model: str
    metadata: dict[str, str]
    created_at_ms: int
    updated_at_ms: int
    message_count: int
    messages: list[Message] = field(default_factory=list)   # filled by get() only
    kind: str = ""                                           # "" (chat) or "response"


@dataclass(frozen=True)
class ConversationChange:
    """What an update changes; None leaves a field as it is."""
    title: str | None = None
    model: str | None = None
    metadata: dict[str, str] | None = None
    keep_messages: int | None = None   # messages with seq >= it are deleted; updated_at moves only then


@dataclass(frozen=True)
class Cursor:
    """A position in an organization's list, newest first: rows strictly after (updated_at_ms, id).

    Keyset, not offset: conversations created while a client pages sort before the cursor,
    so they never shift the rows still to come.
    """
    updated_at_ms: int
    id: str


class ConversationStore(abc.ABC):
    @abc.abstractmethod
    async def create(self, organization_id: str, title: str, model: str,
                     metadata: dict[str, str], kind: str = "") -> Conversation: ...

    @abc.abstractmethod
    async def get(self, organization_id: str, conversation_id: str) -> Conversation:
        """The conversation with its messages in seq order; raises ConversationNotFound."""

    @abc.abstractmethod
    async def list(self, organization_id: str, limit: int,
                   after: Cursor | None = None, kind: str = "") -> list[Conversation]:
        """Up to `limit` conversations of `kind` newest (updated_at_ms, id) first, without messages."""

    @abc.abstractmethod
    async def append(self, organization_id: str, conversation_id: str, messages: list[NewMessage],
                     idempotency_key: str) -> list[Message]:
        """Stores all messages or none, at the next seqs. A key already used for this
        conversation returns the messages that first call stored and stores nothing.
        Raises ConversationNotFound."""

    @abc.abstractmethod
    async def update(self, organization_id: str, conversation_id: str, change: ConversationChange) -> Conversation:
        """Applies the change in one transaction; returns the conversation without messages.
        Raises ConversationNotFound."""

    @abc.abstractmethod
    async def delete(self, organization_id: str, conversation_id: str) -> None:
        """Deletes the conversation and its messages; raises ConversationNotFound."""

    @abc.abstractmethod
    async def migrate(self) -> list[int]:
        """Applies pending migrations; returns the versions applied (none the second time)."""

    @abc.abstractmethod
    async def close(self) -> None: ...


def new_id() -> str:
    return str(uuid.uuid4())


def now_ms() -> int:
    return time.time_ns() // 1_000_000

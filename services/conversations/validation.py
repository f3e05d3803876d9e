"""Request checks: every bad input becomes InvalidArgument with a message naming the field.

The stores trust what passes here, so the checks cover what either database would reject
(NUL characters, malformed UUIDs) as well as the configured limits.
"""

from __future__ import annotations

import uuid

from llmserve.v1 import conversations_pb2 as pb

from .config import LimitsConfig
from .pagination import decode_page_token
from .store import KINDS, ROLES, ConversationChange, Cursor, NewMessage


class InvalidArgument(ValueError):
    """A request field that cannot be served; the message says which and why."""


class RequestValidator:
    def __init__(self, limits: LimitsConfig):
        self.limits = limits

    def organization(self, organization_id: str) -> str:
        return self._required_id("organization_id", organization_id)

    def kind(self, kind: str) -> str:
        if kind not in KINDS:
            raise InvalidArgument(f"kind {kind[:32]!r} is not one of {', '.join(repr(k) for k in KINDS)}")
        return kind

    def conversation_id(self, conversation_id: str) -> str:
        if not conversation_id:
            raise InvalidArgument("conversation_id is required")
        try:
            return str(uuid.UUID(conversation_id))
        except ValueError:
            raise InvalidArgument(f"conversation_id is malformed: {conversation_id[:64]!r} is not a UUID") from None

    def create(self, request: pb.CreateConversationRequest) -> tuple[str, str, str, dict[str, str]]:
        organization_id = self.organization(request.organization_id)
        model = self._optional_id("model", request.model)
        return organization_id, self._title(request.title), model, self._metadata(request.metadata)

    def update(self, request: pb.UpdateConversationRequest) -> tuple[str, str, ConversationChange]:
        organization_id = self.organization(request.organization_id)
        conversation_id = self.conversation_id(request.conversation_id)
        change = ConversationChange(
            title=self._title(request.title) if request.HasField("title") else None,
            model=self._optional_id("model", request.model) if request.HasField("model") else None,
            metadata=self._metadata(request.metadata) if request.replace_metadata else None,
            keep_messages=request.keep_messages if request.HasField("keep_messages") else None)
        if change == ConversationChange():
            raise InvalidArgument("nothing to update: set title, model, metadata (replace_metadata) or keep_messages")
        if request.metadata and not request.replace_metadata:
            raise InvalidArgument("metadata is set but replace_metadata is false")
        return organization_id, conversation_id, change

    def append(self, request: pb.AppendMessagesRequest) -> tuple[str, str, list[NewMessage], str]:
        organization_id = self.organization(request.organization_id)
        conversation_id = self.conversation_id(request.conversation_id)
        idempotency_key = self._required_id("idempotency_key", request.idempotency_key)
        count, most = len(request.messages), self.limits.max_messages_per_append
        if count == 0:
            raise InvalidArgument("messages must not be empty")
        if count > most:
            raise InvalidArgument(f"too many messages: {count} in one call, at most {most}")
        messages = [self._message(i, m) for i, m in enumerate(request.messages)]
        return organization_id, conversation_id, messages, idempotency_key

    def page(self, request: pb.ListConversationsRequest) -> tuple[str, int, Cursor | None]:
        organization_id = self.organization(request.organization_id)
        size = request.page_size or self.limits.default_page_size
        if size > self.limits.max_page_size:
            raise InvalidArgument(f"page_size is {size}, at most {self.limits.max_page_size}")
        try:
            cursor = decode_page_token(request.page_token) if request.page_token else None
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        return organization_id, size, cursor

    def _message(self, index: int, message: pb.NewMessage) -> NewMessage:
        where = f"messages[{index}]"
        if not message.role:
            raise InvalidArgument(f"{where}.role is required: one of {', '.join(ROLES)}")
        if message.role not in ROLES:
            raise InvalidArgument(f"{where}.role {message.role[:32]!r} is not one of {', '.join(ROLES)}")
        content = self._text(f"{where}.content", message.content)
        size = len(content.encode())
        if size > self.limits.max_content_bytes:
            raise InvalidArgument(
                f"{where}.content is too long: {size} bytes, at most {self.limits.max_content_bytes}")
        model = self._optional_id(f"{where}.model", message.model)
        return NewMessage(message.role, content, message.partial, model)

    def _title(self, title: str) -> str:
        self._text("title", title)
        if len(title) > self.limits.max_title_chars:
            raise InvalidArgument(f"title is too long: {len(title)} characters, at most {self.limits.max_title_chars}")
        return title

    def _metadata(self, metadata: dict[str, str]) -> dict[str, str]:
        if len(metadata) > self.limits.max_metadata_entries:
            raise InvalidArgument(f"metadata has {len(metadata)} entries, at most {self.limits.max_metadata_entries}")
        for key, value in metadata.items():
            self._text("metadata key", key)
            self._text(f"metadata[{key!r}]", value)
        size = sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items())
        if size > self.limits.max_metadata_bytes:
            raise InvalidArgument(f"metadata is too large: {size} bytes, at most {self.limits.max_metadata_bytes}")
        return dict(metadata)

    def _required_id(self, field: str, value: str) -> str:
        if not value:
            raise InvalidArgument(f"{field} is required")
        return self._optional_id(field, value)

    def _optional_id(self, field: str, value: str) -> str:
        self._text(field, value)
        if len(value) > self.limits.max_id_chars:
            raise InvalidArgument(f"{field} is too long: {len(value)} characters, at most {self.limits.max_id_chars}")
        return value

    @staticmethod
    def _text(field: str, value: str) -> str:
        if "\x00" in value:   # Postgres text cannot hold NUL; refuse it on every store alike
            raise InvalidArgument(f"{field} must not contain NUL characters")
        return value

"""The llmserve.v1.Conversations servicer: validate, call the store, map results and errors.

Status codes: bad input is INVALID_ARGUMENT; an unknown id, or one of another organization, is
NOT_FOUND (never PERMISSION_DENIED, which would confirm that it exists); anything else INTERNAL.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Awaitable, Callable

import asyncpg
import grpc
from llmserve.v1 import conversations_pb2 as pb
from llmserve.v1 import conversations_pb2_grpc as pb_grpc

from .config import LimitsConfig
from .metrics import Metrics
from .pagination import encode_page_token
from .store import Conversation, ConversationNotFound, ConversationStore, Cursor, Message
from .validation import InvalidArgument, RequestValidator

log = logging.getLogger(__name__)

Handler = Callable[["ConversationsServicer", object], Awaitable[object]]


# Errors that mean the store cannot be reached (Postgres down, a dropped connection, a timeout).
STORE_UNAVAILABLE = (OSError, asyncio.TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError)


def _rpc(handler: Handler):
    """Maps exceptions to status codes and counts every call by method and final code."""
    method = handler.__name__

    @functools.wraps(handler)
    async def call(self: ConversationsServicer, request, context: grpc.aio.ServicerContext):
        code = grpc.StatusCode.CANCELLED   # stays so only if the caller goes away mid-call
        try:
            response = await handler(self, request)
            code = grpc.StatusCode.OK
            return response
        except InvalidArgument as e:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except ConversationNotFound as e:
            code, message = grpc.StatusCode.NOT_FOUND, f"conversation {e} not found"
        except STORE_UNAVAILABLE as e:
            # The database is down or unreachable: retryable, unlike a bug (INTERNAL).
            log.warning("%s: store unavailable: %s", method, e)
            code, message = grpc.StatusCode.UNAVAILABLE, "the conversation store is unavailable; retry later"
        except Exception:
            log.exception("%s failed", method)
            code, message = grpc.StatusCode.INTERNAL, f"{method} failed; see the conversations service log"
        finally:
            self._metrics.requests.labels(method, code.name).inc()
        await context.abort(code, message)

    return call


class ConversationsServicer(pb_grpc.ConversationsServicer):
    def __init__(self, store: ConversationStore, limits: LimitsConfig, metrics: Metrics):
        self._store = store
        self._validate = RequestValidator(limits)
        self._metrics = metrics

    def _timed(self, operation: str):
        return self._metrics.store_seconds.labels(operation).time()

    @_rpc
    async def CreateConversation(self, request: pb.CreateConversationRequest) -> pb.Conversation:
        organization_id, title, model, metadata = self._validate.create(request)
        with self._timed("create"):
            conversation = await self._store.create(organization_id, title, model, metadata,
                                                    self._validate.kind(request.kind))
        return _conversation_pb(conversation)

    @_rpc
    async def GetConversation(self, request: pb.GetConversationRequest) -> pb.Conversation:
        organization_id = self._validate.organization(request.organization_id)
        conversation_id = self._validate.conversation_id(request.conversation_id)
        with self._timed("get"):
            conversation = await self._store.get(organization_id, conversation_id)
        return _conversation_pb(conversation)

    @_rpc
    async def ListConversations(self, request: pb.ListConversationsRequest) -> pb.ListConversationsResponse:
        organization_id, size, cursor = self._validate.page(request)
        with self._timed("list"):
            # One row more than the page tells whether another page follows, without an empty last page.
            rows = await self._store.list(organization_id, size + 1, cursor, self._validate.kind(request.kind))
        page = rows[:size]
        next_token = encode_page_token(Cursor(page[-1].updated_at_ms, page[-1].id)) if len(rows) > size else ""
        return pb.ListConversationsResponse(conversations=[_conversation_pb(c) for c in page],
                                            next_page_token=next_token)

    @_rpc
    async def AppendMessages(self, request: pb.AppendMessagesRequest) -> pb.AppendMessagesResponse:
        organization_id, conversation_id, messages, idempotency_key = self._validate.append(request)
        with self._timed("append"):
            stored = await self._store.append(organization_id, conversation_id, messages, idempotency_key)
        return pb.AppendMessagesResponse(messages=[_message_pb(m) for m in stored])

    @_rpc
    async def UpdateConversation(self, request: pb.UpdateConversationRequest) -> pb.Conversation:
        organization_id, conversation_id, change = self._validate.update(request)
        with self._timed("update"):
            conversation = await self._store.update(organization_id, conversation_id, change)
        return _conversation_pb(conversation)

    @_rpc
    async def DeleteConversation(self, request: pb.DeleteConversationRequest) -> pb.DeleteConversationResponse:
        organization_id = self._validate.organization(request.organization_id)
        conversation_id = self._validate.conversation_id(request.conversation_id)
        with self._timed("delete"):
            await self._store.delete(organization_id, conversation_id)
        return pb.DeleteConversationResponse()


def _conversation_pb(c: Conversation) -> pb.Conversation:
    return pb.Conversation(
        id=c.id, organization_id=c.organization_id, title=c.title, model=c.model,
        created_at_ms=c.created_at_ms, updated_at_ms=c.updated_at_ms, metadata=c.metadata,
        message_count=c.message_count, messages=[_message_pb(m) for m in c.messages], kind=c.kind)


def _message_pb(m: Message) -> pb.StoredMessage:
    return pb.StoredMessage(id=m.id, role=m.role, content=m.content, created_at_ms=m.created_at_ms,
                            partial=m.partial, model=m.model, seq=m.seq)

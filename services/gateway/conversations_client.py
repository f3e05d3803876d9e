"""gRPC client of llmserve.v1.Conversations. Every call is scoped by organization, so another
organization's conversation is simply not found."""

from __future__ import annotations

import asyncio
import logging

import grpc

from llmserve.v1 import conversations_pb2 as pb
from llmserve.v1 import conversations_pb2_grpc
from services.gateway.config import ConversationsConfig
from services.gateway.errors import ApiError
from services.gateway.request_context import REQUEST_ID
from services.gateway.upstream import api_error_from_grpc

log = logging.getLogger(__name__)
# Failures after which the append may or may not have been applied, or may work a moment later.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.ABORTED}


def _error(e: grpc.aio.AioRpcError, conversation_id: str = "") -> ApiError:
    if e.code() == grpc.StatusCode.NOT_FOUND:
        return ApiError(404, f"no conversation `{conversation_id}`", param="conversation_id",
                        code="conversation_not_found")
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, e.details() or "invalid conversation request", code="invalid_value")
    return api_error_from_grpc(e, "conversation service")


class ConversationsClient:
    def __init__(self, cfg: ConversationsConfig):
        self._timeout = cfg.timeout_s
        self._append_attempts = max(1, cfg.append_attempts)
        self._append_backoff_s = cfg.append_backoff_s
        self._channel = grpc.aio.insecure_channel(cfg.address)
        self._stub = conversations_pb2_grpc.ConversationsStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def create(self, org_id: str, title: str, model: str, metadata: dict[str, str],
                     kind: str = "") -> pb.Conversation:
        return await self._call(self._stub.CreateConversation, pb.CreateConversationRequest(
            organization_id=org_id, title=title, model=model, metadata=metadata, kind=kind))

    async def get(self, org_id: str, conversation_id: str) -> pb.Conversation:
        return await self._call(self._stub.GetConversation, pb.GetConversationRequest(
            organization_id=org_id, conversation_id=conversation_id), conversation_id)

    async def get_chat(self, org_id: str, conversation_id: str) -> pb.Conversation:
        """A chat conversation; a stored /v1/responses response (another kind) is not found here."""
        conversation = await self.get(org_id, conversation_id)
        if conversation.kind:
            raise ApiError(404, f"no conversation `{conversation_id}`", param="conversation_id",
                           code="conversation_not_found")
        return conversation

    async def list(self, org_id: str, page_size: int, page_token: str) -> pb.ListConversationsResponse:
        return await self._call(self._stub.ListConversations, pb.ListConversationsRequest(
            organization_id=org_id, page_size=page_size, page_token=page_token))

    async def append(self, org_id: str, conversation_id: str, messages: list[pb.NewMessage],
                     idempotency_key: str) -> list[pb.StoredMessage]:
        """Retried with bounded backoff while the failure may be transient. The service stores an
        idempotency key once, so a retry cannot double-store, even after an attempt that was applied
        but whose answer was lost (a timeout)."""
        request = pb.AppendMessagesRequest(organization_id=org_id, conversation_id=conversation_id,
                                           messages=messages, idempotency_key=idempotency_key)
        for attempt in range(1, self._append_attempts + 1):
            try:
                return list((await self._stub.AppendMessages(request, timeout=self._timeout)).messages)
            except grpc.aio.AioRpcError as e:
                if attempt == self._append_attempts or e.code() not in _RETRYABLE:
                    raise _error(e, conversation_id) from None
                log.info("request %s: append to conversation %s failed (%s), attempt %d of %d; retrying",
                         REQUEST_ID.get(), conversation_id, e.code().name, attempt, self._append_attempts)
            await asyncio.sleep(self._append_backoff_s * 2 ** (attempt - 1))

    async def update(self, org_id: str, conversation_id: str, title: str | None, model: str | None,
                     metadata: dict[str, str] | None, keep_messages: int | None) -> pb.Conversation:
        """None leaves a field unchanged; keep_messages drops the messages from that position on."""
        request = pb.UpdateConversationRequest(organization_id=org_id, conversation_id=conversation_id,
                                               title=title, model=model, keep_messages=keep_messages,
                                               replace_metadata=metadata is not None, metadata=metadata)
        return await self._call(self._stub.UpdateConversation, request, conversation_id)

    async def delete(self, org_id: str, conversation_id: str) -> None:
        await self._call(self._stub.DeleteConversation, pb.DeleteConversationRequest(
            organization_id=org_id, conversation_id=conversation_id), conversation_id)

    async def _call(self, rpc, request, conversation_id: str = ""):
        try:
            return await rpc(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            raise _error(e, conversation_id) from None

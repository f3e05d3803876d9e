"""gRPC client of llmserve.v1.Conversations. Every call is scoped by organization, so another
organization's conversation is simply not found."""

from __future__ import annotations

import grpc

from llmserve.v1 import conversations_pb2 as pb
from llmserve.v1 import conversations_pb2_grpc
from services.gateway.config import ConversationsConfig
from services.gateway.errors import ApiError
from services.gateway.upstream import api_error_from_grpc


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
        self._channel = grpc.aio.insecure_channel(cfg.address)
        self._stub = conversations_pb2_grpc.ConversationsStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def create(self, org_id: str, title: str, model: str, metadata: dict[str, str]) -> pb.Conversation:
        return await self._call(self._stub.CreateConversation, pb.CreateConversationRequest(
            organization_id=org_id, title=title, model=model, metadata=metadata))

    async def get(self, org_id: str, conversation_id: str) -> pb.Conversation:
        return await self._call(self._stub.GetConversation, pb.GetConversationRequest(
            organization_id=org_id, conversation_id=conversation_id), conversation_id)

    async def list(self, org_id: str, page_size: int, page_token: str) -> pb.ListConversationsResponse:
        return await self._call(self._stub.ListConversations, pb.ListConversationsRequest(
            organization_id=org_id, page_size=page_size, page_token=page_token))

    async def append(self, org_id: str, conversation_id: str, messages: list[pb.NewMessage],
                     idempotency_key: str) -> list[pb.StoredMessage]:
        reply = await self._call(self._stub.AppendMessages, pb.AppendMessagesRequest(
            organization_id=org_id, conversation_id=conversation_id, messages=messages,
            idempotency_key=idempotency_key), conversation_id)
        return list(reply.messages)

    async def delete(self, org_id: str, conversation_id: str) -> None:
        await self._call(self._stub.DeleteConversation, pb.DeleteConversationRequest(
            organization_id=org_id, conversation_id=conversation_id), conversation_id)

    async def _call(self, rpc, request, conversation_id: str = ""):
        try:
            return await rpc(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            raise _error(e, conversation_id) from None

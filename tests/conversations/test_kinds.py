"""Stored /v1/responses responses live beside chat conversations (kind "response") and stay out of
their listing, over gRPC, on both stores."""

from __future__ import annotations

import grpc
import pytest

from llmserve.v1 import conversations_pb2 as pb


async def test_responses_are_listed_apart_from_conversations(stub, org):
    chat = await stub.CreateConversation(pb.CreateConversationRequest(organization_id=org, title="chat"))
    response = await stub.CreateConversation(pb.CreateConversationRequest(organization_id=org, kind="response"))
    assert (chat.kind, response.kind) == ("", "response")
    plain = await stub.ListConversations(pb.ListConversationsRequest(organization_id=org))
    assert [c.id for c in plain.conversations] == [chat.id]
    stored = await stub.ListConversations(pb.ListConversationsRequest(organization_id=org, kind="response"))
    assert [c.id for c in stored.conversations] == [response.id]
    got = await stub.GetConversation(pb.GetConversationRequest(organization_id=org, conversation_id=response.id))
    assert got.kind == "response"


@pytest.mark.parametrize("call", ["create", "list"])
async def test_unknown_kind_is_invalid_argument(stub, org, call):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        if call == "create":
            await stub.CreateConversation(pb.CreateConversationRequest(organization_id=org, kind="diary"))
        else:
            await stub.ListConversations(pb.ListConversationsRequest(organization_id=org, kind="diary"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kind" in e.value.details()

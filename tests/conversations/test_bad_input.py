"""Every kind of bad input gets the right gRPC status and a message naming the problem.

Sizes are against the small limits of harness.TEST_LIMITS.
"""

from __future__ import annotations

import base64
import uuid

import grpc
import pytest
from llmserve.v1 import conversations_pb2 as pb

INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
UNKNOWN_ID = str(uuid.uuid4())


def msg(role: str = "user", content: str = "hi", **kw) -> pb.NewMessage:
    return pb.NewMessage(role=role, content=content, **kw)


def token(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def create(**changes):
    return "CreateConversation", lambda org, cid: {"organization_id": org, **changes}


def get(**changes):
    return "GetConversation", lambda org, cid: {"organization_id": org, "conversation_id": cid, **changes}


def listing(**changes):
    return "ListConversations", lambda org, cid: {"organization_id": org, **changes}


def append(**changes):
    return "AppendMessages", lambda org, cid: {"organization_id": org, "conversation_id": cid,
                                               "idempotency_key": "k", "messages": [msg()], **changes}


def delete(**changes):
    return "DeleteConversation", lambda org, cid: {"organization_id": org, "conversation_id": cid, **changes}


# (name, (rpc, request fields given the org and an existing conversation id), code, words in the message)
CASES = [
    ("create without org", create(organization_id=""), INVALID, "organization_id is required"),
    ("create org too long", create(organization_id="o" * 41), INVALID, "organization_id is too long"),
    ("create org with NUL", create(organization_id="a\x00b"), INVALID, "NUL"),
    ("create title too long", create(title="t" * 51), INVALID, "title is too long"),
    ("create model too long", create(model="m" * 41), INVALID, "model is too long"),
    ("create too many metadata", create(metadata={str(i): "v" for i in range(4)}), INVALID, "metadata has 4 entries"),
    ("create metadata too large", create(metadata={"k": "v" * 100}), INVALID, "metadata is too large"),
    ("create metadata with NUL", create(metadata={"k": "\x00"}), INVALID, "NUL"),
    ("get without org", get(organization_id=""), INVALID, "organization_id is required"),
    ("get without id", get(conversation_id=""), INVALID, "conversation_id is required"),
    ("get malformed id", get(conversation_id="nope' OR 1=1"), INVALID, "conversation_id is malformed"),
    ("get unknown id", get(conversation_id=UNKNOWN_ID), NOT_FOUND, UNKNOWN_ID),
    ("list without org", listing(organization_id=""), INVALID, "organization_id is required"),
    ("list page too large", listing(page_size=101), INVALID, "page_size is 101, at most 100"),
    ("list garbage token", listing(page_token="!!!"), INVALID, "page_token is malformed"),
    ("list token of another version", listing(page_token=token(f"v9:1:{UNKNOWN_ID}")), INVALID, "page_token is malformed"),
    ("list token with bad id", listing(page_token=token("v1:1:xyz")), INVALID, "page_token is malformed"),
    ("list token with bad time", listing(page_token=token(f"v1:-5:{UNKNOWN_ID}")), INVALID, "page_token is malformed"),
    ("append without org", append(organization_id=""), INVALID, "organization_id is required"),
    ("append without key", append(idempotency_key=""), INVALID, "idempotency_key is required"),
    ("append key too long", append(idempotency_key="k" * 41), INVALID, "idempotency_key is too long"),
    ("append malformed id", append(conversation_id="123"), INVALID, "conversation_id is malformed"),
    ("append no messages", append(messages=[]), INVALID, "messages must not be empty"),
    ("append too many messages", append(messages=[msg()] * 6), INVALID, "too many messages: 6"),
    ("append empty role", append(messages=[msg(), msg(role="")]), INVALID, "messages[1].role is required"),
    ("append unknown role", append(messages=[msg(role="admin")]), INVALID,
     "'admin' is not one of system, user, assistant, tool"),
    ("append content too long", append(messages=[msg(content="é" * 501)]), INVALID, "1002 bytes, at most 1000"),
    ("append content with NUL", append(messages=[msg(content="a\x00")]), INVALID, "messages[0].content must not contain NUL"),
    ("append model too long", append(messages=[msg(model="m" * 41)]), INVALID, "messages[0].model is too long"),
    ("append unknown id", append(conversation_id=UNKNOWN_ID), NOT_FOUND, UNKNOWN_ID),
    ("delete without org", delete(organization_id=""), INVALID, "organization_id is required"),
    ("delete malformed id", delete(conversation_id="x"), INVALID, "conversation_id is malformed"),
    ("delete unknown id", delete(conversation_id=UNKNOWN_ID), NOT_FOUND, UNKNOWN_ID),
]

REQUESTS = {"CreateConversation": pb.CreateConversationRequest, "GetConversation": pb.GetConversationRequest,
            "ListConversations": pb.ListConversationsRequest, "AppendMessages": pb.AppendMessagesRequest,
            "DeleteConversation": pb.DeleteConversationRequest}


@pytest.mark.parametrize("name, call, code, words", CASES, ids=[c[0] for c in CASES])
async def test_bad_input(stub, org, name, call, code, words):
    conversation = await stub.CreateConversation(pb.CreateConversationRequest(organization_id=org))
    rpc, fields = call
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await getattr(stub, rpc)(REQUESTS[rpc](**fields(org, conversation.id)))
    assert raised.value.code() == code, raised.value.details()
    assert words in raised.value.details()
    # A refused call changed nothing.
    after = await stub.GetConversation(pb.GetConversationRequest(organization_id=org, conversation_id=conversation.id))
    assert after.message_count == 0 and list(after.messages) == []
    listed = await stub.ListConversations(pb.ListConversationsRequest(organization_id=org))
    assert [c.id for c in listed.conversations] == [conversation.id]


async def test_the_same_calls_without_the_fault_succeed(stub, org):
    """The cases above differ from a valid call only in the field they break."""
    conversation = await stub.CreateConversation(pb.CreateConversationRequest(organization_id=org))
    for rpc, fields in (create(), get(), listing(), append(), delete()):
        await getattr(stub, rpc)(REQUESTS[rpc](**fields(org, conversation.id)))

"""UpdateConversation on SQLite and Postgres: rename, settings in metadata, and dropping the tail of
the messages (what regenerate and edit-and-resend need)."""

from __future__ import annotations

import grpc
from llmserve.v1 import conversations_pb2 as pb

from tests.conversations.test_conversations import append, create, expect_status, get, list_page


def update(stub, org: str, conversation_id: str, **fields):
    return stub.UpdateConversation(pb.UpdateConversationRequest(organization_id=org, conversation_id=conversation_id,
                                                                **fields))


async def test_rename_and_settings_keep_messages_and_list_order(stub, org):
    older = await create(stub, org, "older", model="m1", metadata={"temperature": "0.7"})
    newer = await create(stub, org, "newer")
    await append(stub, org, older.id, "k1", "hello")
    await append(stub, org, newer.id, "k2", "hi")

    renamed = await update(stub, org, older.id, title="Renamed", model="m2",
                           replace_metadata=True, metadata={"temperature": "0.2", "max_tokens": "64"})
    assert renamed.title == "Renamed" and renamed.model == "m2"
    assert dict(renamed.metadata) == {"temperature": "0.2", "max_tokens": "64"}
    got = await get(stub, org, older.id)
    assert got.title == "Renamed" and dict(got.metadata) == dict(renamed.metadata)
    assert [m.content for m in got.messages] == ["hello"] and got.message_count == 1
    # A rename is not activity: the list keeps its order (newest message first).
    assert [c.id for c in (await list_page(stub, org)).conversations] == [newer.id, older.id]

    only_title = await update(stub, org, older.id, title="Again")
    assert only_title.model == "m2" and dict(only_title.metadata) == dict(renamed.metadata)
    cleared = await update(stub, org, older.id, replace_metadata=True)
    assert dict(cleared.metadata) == {} and cleared.title == "Again"


async def test_an_update_keeps_the_kind(stub, org):
    stored = await stub.CreateConversation(pb.CreateConversationRequest(organization_id=org, kind="response"))
    renamed = await update(stub, org, stored.id, title="named")
    assert renamed.kind == "response" and (await get(stub, org, stored.id)).kind == "response"


async def test_keep_messages_drops_the_tail_and_its_idempotency_keys(stub, org):
    conversation = await create(stub, org)
    await append(stub, org, conversation.id, "turn-1", "q1", "a1")
    await append(stub, org, conversation.id, "turn-2", "q2", "a2")
    before = await get(stub, org, conversation.id)

    kept = await update(stub, org, conversation.id, keep_messages=2)
    assert kept.message_count == 2 and kept.updated_at_ms >= before.updated_at_ms
    assert [(m.seq, m.content) for m in (await get(stub, org, conversation.id)).messages] == [(0, "q1"), (1, "a1")]

    # The dropped turn's key stores anew (its replay must not answer with messages that are gone);
    # the kept turn's key still replays.
    again = await append(stub, org, conversation.id, "turn-2", "q2 edited", "a2 new")
    assert [(m.seq, m.content) for m in again] == [(2, "q2 edited"), (3, "a2 new")]
    replay = await append(stub, org, conversation.id, "turn-1", "ignored")
    assert [m.content for m in replay] == ["q1", "a1"]
    assert (await get(stub, org, conversation.id)).message_count == 4

    # Past the end changes nothing; 0 empties the conversation.
    assert (await update(stub, org, conversation.id, keep_messages=10)).message_count == 4
    assert (await update(stub, org, conversation.id, keep_messages=0)).message_count == 0
    assert list((await get(stub, org, conversation.id)).messages) == []


async def test_bad_updates(stub, org):
    conversation = await create(stub, org)
    details = await expect_status(grpc.StatusCode.INVALID_ARGUMENT, update(stub, org, conversation.id))
    assert "nothing to update" in details
    details = await expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                                  update(stub, org, conversation.id, metadata={"a": "b"}))
    assert "replace_metadata" in details
    details = await expect_status(grpc.StatusCode.INVALID_ARGUMENT, update(stub, org, conversation.id, title="x" * 51))
    assert "title is too long" in details
    details = await expect_status(grpc.StatusCode.INVALID_ARGUMENT, update(
        stub, org, conversation.id, replace_metadata=True, metadata={"a": "1", "b": "2", "c": "3", "d": "4"}))
    assert "metadata has 4 entries" in details
    details = await expect_status(grpc.StatusCode.INVALID_ARGUMENT, update(stub, org, "nope", title="x"))
    assert "not a UUID" in details
    # Another organization's conversation is not found, and stays as it was.
    await expect_status(grpc.StatusCode.NOT_FOUND, update(stub, org + "-other", conversation.id, title="stolen"))
    assert (await get(stub, org, conversation.id)).title == "chat"

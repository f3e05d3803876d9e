"""Behaviour through gRPC, on SQLite and on Postgres alike (the store_url fixture)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from llmserve.v1 import conversations_pb2 as pb


async def create(stub, org: str, title: str = "chat", **kw) -> pb.Conversation:
    return await stub.CreateConversation(pb.CreateConversationRequest(organization_id=org, title=title, **kw))


async def append(stub, org: str, conversation_id: str, key: str, *contents: str, role: str = "user"):
    request = pb.AppendMessagesRequest(organization_id=org, conversation_id=conversation_id, idempotency_key=key,
                                       messages=[pb.NewMessage(role=role, content=c) for c in contents])
    return (await stub.AppendMessages(request)).messages


async def get(stub, org: str, conversation_id: str) -> pb.Conversation:
    return await stub.GetConversation(pb.GetConversationRequest(organization_id=org, conversation_id=conversation_id))


async def list_page(stub, org: str, size: int = 0, token: str = "") -> pb.ListConversationsResponse:
    return await stub.ListConversations(pb.ListConversationsRequest(organization_id=org, page_size=size,
                                                                    page_token=token))


async def expect_status(code: grpc.StatusCode, call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    assert raised.value.code() == code, raised.value.details()
    return raised.value.details()


async def test_create_append_get_round_trip(stub, org):
    created = await create(stub, org, "first chat", model="smollm2-135m-instruct", metadata={"source": "web"})
    assert created.organization_id == org and created.title == "first chat"
    assert created.model == "smollm2-135m-instruct" and dict(created.metadata) == {"source": "web"}
    assert created.message_count == 0 and created.created_at_ms == created.updated_at_ms > 0

    await append(stub, org, created.id, "k1", "hello", "how are you?")
    reply = pb.NewMessage(role="assistant", content="fine, thanks", partial=True, model="smollm2-135m-instruct")
    stored = (await stub.AppendMessages(pb.AppendMessagesRequest(
        organization_id=org, conversation_id=created.id, idempotency_key="k2", messages=[reply]))).messages
    assert [m.seq for m in stored] == [2] and stored[0].partial and stored[0].model == reply.model

    got = await get(stub, org, created.id)
    assert [(m.seq, m.role, m.content) for m in got.messages] == [
        (0, "user", "hello"), (1, "user", "how are you?"), (2, "assistant", "fine, thanks")]
    assert got.message_count == 3 and got.updated_at_ms >= created.updated_at_ms
    assert got.messages[2].id == stored[0].id and len({m.id for m in got.messages}) == 3
    assert dict(got.metadata) == {"source": "web"} and got.created_at_ms == created.created_at_ms


async def test_unicode_content_and_exact_limit_are_stored_verbatim(stub, org):
    conversation = await create(stub, org)
    text = "é" * 500   # 1000 bytes: exactly the test limit
    await append(stub, org, conversation.id, "k", text, "日本語 🙂 \n\t")
    assert [m.content for m in (await get(stub, org, conversation.id)).messages] == [text, "日本語 🙂 \n\t"]


async def test_other_organizations_see_nothing(stub, org):
    conversation = await create(stub, org)
    await append(stub, org, conversation.id, "k", "secret")
    intruder = org + "-other"
    await expect_status(grpc.StatusCode.NOT_FOUND, get(stub, intruder, conversation.id))
    await expect_status(grpc.StatusCode.NOT_FOUND, append(stub, intruder, conversation.id, "k2", "injected"))
    await expect_status(grpc.StatusCode.NOT_FOUND, stub.DeleteConversation(
        pb.DeleteConversationRequest(organization_id=intruder, conversation_id=conversation.id)))
    assert list((await list_page(stub, intruder)).conversations) == []
    # Unharmed for its owner.
    owned = await get(stub, org, conversation.id)
    assert [m.content for m in owned.messages] == ["secret"]
    assert [c.id for c in (await list_page(stub, org)).conversations] == [conversation.id]


async def test_delete_removes_conversation_and_messages(stub, org):
    kept, doomed = await create(stub, org, "kept"), await create(stub, org, "doomed")
    await append(stub, org, doomed.id, "k", "bye")
    await stub.DeleteConversation(pb.DeleteConversationRequest(organization_id=org, conversation_id=doomed.id))
    await expect_status(grpc.StatusCode.NOT_FOUND, get(stub, org, doomed.id))
    await expect_status(grpc.StatusCode.NOT_FOUND, append(stub, org, doomed.id, "k2", "again"))
    await expect_status(grpc.StatusCode.NOT_FOUND, stub.DeleteConversation(
        pb.DeleteConversationRequest(organization_id=org, conversation_id=doomed.id)))
    assert [c.id for c in (await list_page(stub, org)).conversations] == [kept.id]


async def test_list_is_newest_update_first_without_messages(stub, org):
    oldest, middle, newest = [await create(stub, org, t) for t in ("oldest", "middle", "newest")]
    await asyncio.sleep(0.002)   # the append's updated_at is then strictly later than every creation
    await append(stub, org, oldest.id, "k", "bump")
    listed = (await list_page(stub, org)).conversations
    assert listed[0].id == oldest.id and listed[0].message_count == 1
    assert {c.id for c in listed} == {oldest.id, middle.id, newest.id}
    assert all(len(c.messages) == 0 for c in listed)
    keys = [(c.updated_at_ms, c.id) for c in listed]
    assert keys == sorted(keys, reverse=True)


async def test_pagination_has_no_gaps_or_duplicates_under_concurrent_inserts(stub, org):
    originals = {(await create(stub, org, f"c{i}")).id for i in range(7)}
    seen, token, pages = [], "", 0
    while True:
        page = await list_page(stub, org, size=3, token=token)
        seen += [c for c in page.conversations]
        pages += 1
        # Inserted between page fetches: they sort before the cursor and must not shift later pages.
        await create(stub, org, f"late{pages}")
        token = page.next_page_token
        if not token:
            break
    ids = [c.id for c in seen]
    assert len(ids) == len(set(ids)), "a conversation appeared on two pages"
    assert originals <= set(ids), "a conversation was skipped"
    keys = [(c.updated_at_ms, c.id) for c in seen]
    assert keys == sorted(keys, reverse=True)
    assert pages == 3


async def test_default_page_size_and_last_page_token(stub, org):
    for i in range(5):
        await create(stub, org, f"c{i}")
    first = await list_page(stub, org)        # default page size 4 in the test limits
    assert len(first.conversations) == 4 and first.next_page_token
    last = await list_page(stub, org, token=first.next_page_token)
    assert len(last.conversations) == 1 and last.next_page_token == ""
    exact = await list_page(stub, org, size=5)   # a full last page has no token either
    assert len(exact.conversations) == 5 and exact.next_page_token == ""


async def test_retried_append_is_stored_once(stub, org):
    conversation = await create(stub, org)
    first = await append(stub, org, conversation.id, "turn-1", "hello", "again")
    retry = await append(stub, org, conversation.id, "turn-1", "hello", "again")
    assert [(m.id, m.seq) for m in retry] == [(m.id, m.seq) for m in first]
    # The key is per conversation: another conversation may use it.
    other = await create(stub, org)
    assert [m.seq for m in await append(stub, org, other.id, "turn-1", "hi")] == [0]
    got = await get(stub, org, conversation.id)
    assert got.message_count == 2 and [m.content for m in got.messages] == ["hello", "again"]


async def test_concurrent_retries_store_once(stub, org):
    conversation = await create(stub, org)
    results = await asyncio.gather(*(append(stub, org, conversation.id, "same-key", "a", "b", "c")
                                     for _ in range(8)))
    assert len({tuple(m.id for m in r) for r in results}) == 1
    got = await get(stub, org, conversation.id)
    assert got.message_count == 3 and [m.seq for m in got.messages] == [0, 1, 2]


async def test_concurrent_appends_get_contiguous_seqs(stub, org):
    conversation = await create(stub, org)
    calls, per_call = 10, 3
    results = await asyncio.gather(*(append(stub, org, conversation.id, f"key-{i}", *(f"{i}.{j}" for j in range(per_call)))
                                     for i in range(calls)))
    for stored in results:   # each call's messages are one contiguous run, in the order sent
        seqs = [m.seq for m in stored]
        assert seqs == list(range(seqs[0], seqs[0] + per_call))
    got = await get(stub, org, conversation.id)
    assert [m.seq for m in got.messages] == list(range(calls * per_call))
    assert got.message_count == calls * per_call
    assert sorted(m.content for m in got.messages) == sorted(f"{i}.{j}" for i in range(calls) for j in range(per_call))

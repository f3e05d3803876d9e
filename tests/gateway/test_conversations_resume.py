"""Conversations through the gateway, over the real conversations service: CRUD, resume with
history trimmed to the context, and a partial reply kept when the client went away."""

from __future__ import annotations

import time

import openai
import pytest

from tests.gateway.harness import GatewayHarness


@pytest.fixture(scope="module")
def key(gateway: GatewayHarness) -> str:
    return gateway.new_org("chat-history")[2]


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def new_conversation(gateway: GatewayHarness, key: str, **body) -> str:
    reply = gateway.http.post("/v1/conversations", json=body, headers=auth(key))
    assert reply.status_code == 201, reply.text
    return reply.json()["id"]


def messages_of(gateway: GatewayHarness, key: str, cid: str) -> list[dict]:
    gateway.drain()
    reply = gateway.http.get(f"/v1/conversations/{cid}", headers=auth(key))
    assert reply.status_code == 200
    return reply.json()["messages"]


def test_create_list_get_delete(gateway, key):
    cid = new_conversation(gateway, key, title="plans", model="fake-model", metadata={"k": "v"})
    listed = gateway.http.get("/v1/conversations?limit=5", headers=auth(key)).json()
    assert listed["object"] == "list" and cid in [c["id"] for c in listed["data"]]
    got = gateway.http.get(f"/v1/conversations/{cid}", headers=auth(key)).json()
    assert (got["title"], got["model"], got["metadata"], got["messages"]) == ("plans", "fake-model", {"k": "v"}, [])
    deleted = gateway.http.delete(f"/v1/conversations/{cid}", headers=auth(key)).json()
    assert deleted == {"id": cid, "object": "conversation.deleted", "deleted": True}
    assert gateway.http.get(f"/v1/conversations/{cid}", headers=auth(key)).status_code == 404
    assert gateway.http.post("/v1/conversations", json={"model": "nope"}, headers=auth(key)).status_code == 404
    assert gateway.http.get("/v1/conversations?limit=0", headers=auth(key)).status_code == 400


def test_resume_sends_history_and_stores_the_turn(gateway, key):
    cid = new_conversation(gateway, key)
    sdk = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key)
    sdk.chat.completions.create(model="fake-model", extra_body={"conversation_id": cid}, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "first"}])
    sdk.chat.completions.create(model="fake-model", extra_body={"conversation_id": cid},
                                messages=[{"role": "user", "content": "second"}])
    sent = gateway.fake.calls[-1].request.chat.messages
    assert [(m.role, m.content) for m in sent] == [
        ("system", "be brief"), ("user", "first"), ("assistant", "Hello there friend"), ("user", "second")]
    stored = messages_of(gateway, key, cid)
    assert [(m["role"], m["content"], m["partial"]) for m in stored] == [
        ("system", "be brief", False), ("user", "first", False), ("assistant", "Hello there friend", False),
        ("user", "second", False), ("assistant", "Hello there friend", False)]
    assert stored[2]["model"] == "fake-model"


def test_history_is_trimmed_oldest_turn_first_keeping_the_system_message(gateway, key):
    """tiny-model has 64 tokens; the fake counts words + 3 per message; 32 are kept for the reply."""
    cid = new_conversation(gateway, key)
    sdk = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key)
    turns = ["one two three four five", "six seven eight nine ten", "eleven twelve"]
    sdk.chat.completions.create(model="tiny-model", extra_body={"conversation_id": cid}, messages=[
        {"role": "system", "content": "sys"}, {"role": "user", "content": turns[0]}])
    for text in turns[1:]:
        sdk.chat.completions.create(model="tiny-model", extra_body={"conversation_id": cid},
                                    messages=[{"role": "user", "content": text}])
    sent = [(m.role, m.content) for m in gateway.fake.calls[-1].request.chat.messages]
    assert sent[0] == ("system", "sys") and sent[-1] == ("user", "eleven twelve")
    assert ("user", turns[0]) not in sent                  # the oldest turn went first
    assert ("user", turns[1]) in sent                      # the newer one still fits
    with pytest.raises(openai.BadRequestError) as e:       # the new message alone is too big
        sdk.chat.completions.create(model="tiny-model", extra_body={"conversation_id": cid},
                                    messages=[{"role": "user", "content": "x " * 40}])
    assert e.value.code == "context_length_exceeded"


def test_partial_reply_is_kept_when_the_client_goes_away(gateway, key):
    cid = new_conversation(gateway, key)
    with gateway.http.stream("POST", "/v1/chat/completions", headers=auth(key), json={
            "model": "fake-model", "stream": True, "conversation_id": cid,
            "messages": [{"role": "user", "content": "[drip] tell me"}]}) as reply:
        for line in reply.iter_lines():
            if '"d2 "' in line:
                break
    deadline = time.monotonic() + 5
    while len(stored := messages_of(gateway, key, cid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(m["role"], m["partial"]) for m in stored] == [("user", False), ("assistant", True)]
    assert stored[1]["content"].startswith("d0 d1 d2 ")

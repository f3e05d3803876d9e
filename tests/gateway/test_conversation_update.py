"""POST /v1/conversations/{id}: rename, model and metadata (the chat page's settings), keep_messages;
every kind of bad input is a 400 naming its parameter, another organization's conversation a 404."""

from __future__ import annotations

import pytest

from tests.gateway.harness import GatewayHarness


@pytest.fixture(scope="module")
def auth(gateway: GatewayHarness) -> dict[str, str]:
    return {"Authorization": f"Bearer {gateway.new_org('update')[2]}"}


def new_conversation(gateway: GatewayHarness, auth: dict[str, str]) -> str:
    created = gateway.http.post("/v1/conversations", headers=auth, json={"title": "chat", "model": "fake-model"})
    assert created.status_code == 201, created.text
    return created.json()["id"]


def test_update_and_truncate(gateway: GatewayHarness, auth):
    conversation_id = new_conversation(gateway, auth)
    for text in ("[words:2] one", "[words:2] two"):
        reply = gateway.http.post("/v1/chat/completions", headers=auth, json={
            "model": "fake-model", "conversation_id": conversation_id, "messages": [{"role": "user", "content": text}]})
        assert reply.status_code == 200, reply.text
    url = f"/v1/conversations/{conversation_id}"
    updated = gateway.http.post(url, headers=auth, json={"title": "Renamed", "model": "tiny-model",
                                                        "metadata": {"temperature": "0.2"}})
    assert updated.status_code == 200, updated.text
    body = updated.json()
    assert (body["title"], body["model"], body["metadata"], body["message_count"]) == (
        "Renamed", "tiny-model", {"temperature": "0.2"}, 4)

    assert gateway.http.post(url, headers=auth, json={"keep_messages": 2}).json()["message_count"] == 2
    got = gateway.http.get(url, headers=auth).json()
    assert [m["content"] for m in got["messages"]] == ["[words:2] one", "w0 w1 "]
    assert got["title"] == "Renamed" and got["metadata"] == {"temperature": "0.2"}


@pytest.mark.parametrize("body, param", [
    ({}, None),
    ({"title": 5}, "title"),
    ({"title": "x" * 257}, "title"),
    ({"metadata": {"a": 1}}, "metadata"),
    ({"metadata": ["a"]}, "metadata"),
    ({"keep_messages": -1}, "keep_messages"),
    ({"keep_messages": "2"}, "keep_messages"),
    ({"keep_messages": True}, "keep_messages"),
    ({"colour": "red"}, "colour"),
])
def test_bad_updates_are_400(gateway: GatewayHarness, auth, body, param):
    reply = gateway.http.post(f"/v1/conversations/{new_conversation(gateway, auth)}", headers=auth, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_unknown_model_other_organization_and_not_json(gateway: GatewayHarness, auth):
    conversation_id = new_conversation(gateway, auth)
    url = f"/v1/conversations/{conversation_id}"
    assert gateway.http.post(url, headers=auth, json={"model": "no-such-model"}).status_code == 404
    stranger = {"Authorization": f"Bearer {gateway.new_org('stranger')[2]}"}
    reply = gateway.http.post(url, headers=stranger, json={"title": "mine now"})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "conversation_not_found"
    assert gateway.http.post(url, headers=auth, content=b"{oops").json()["error"]["code"] == "invalid_json"
    assert gateway.http.get(url, headers=auth).json()["title"] == "chat"

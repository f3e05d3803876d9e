"""The SSE wire format, byte for byte where the SDK cares."""

from __future__ import annotations

import json

import pytest

from tests.gateway.harness import GatewayHarness


@pytest.fixture(scope="module")
def key(gateway: GatewayHarness) -> str:
    return gateway.new_org("sse")[2]


def stream_events(gateway: GatewayHarness, key: str, body: dict) -> tuple[dict, list[str]]:
    with gateway.http.stream("POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "fake-model", "stream": True, **body}) as reply:
        assert reply.status_code == 200
        text = "".join(reply.iter_text())
        headers = dict(reply.headers)
    assert text.endswith("data: [DONE]\n\n")
    events = [e for e in text.split("\n\n") if e]
    return headers, events


def test_chunks_share_id_and_created_and_end_with_usage_and_done(gateway, key):
    headers, events = stream_events(gateway, key, {"messages": [{"role": "user", "content": "hi"}],
                                                   "stream_options": {"include_usage": True}})
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["x-request-id"]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(e.startswith("data: ") for e in events)
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "fake-model" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"]]
    assert finishes[-1] == "stop" and finishes.count("stop") == 1


def test_without_include_usage_no_usage_field(gateway, key):
    _, events = stream_events(gateway, key, {"messages": [{"role": "user", "content": "hi"}]})
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello there friend"


def test_n_choices_each_get_role_and_finish(gateway, key):
    _, events = stream_events(gateway, key, {"messages": [{"role": "user", "content": "hi"}], "n": 3})
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    for index in range(3):
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(ch["delta"].get("content", "") for ch in mine) == "Hello there friend"
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["stop"]


def test_keepalive_comments_while_waiting(gateway, key):
    """[words:1] answers at once; a hanging request shows keep-alive comments, then the client leaves."""
    with gateway.http.stream("POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "fake-model", "stream": True,
                                   "messages": [{"role": "user", "content": "[hang]"}]}) as reply:
        lines = reply.iter_lines()
        assert next(lines) == ": keep-alive"


def test_error_mid_stream_is_error_event_then_done(gateway, key):
    _, events = stream_events(gateway, key, {"messages": [{"role": "user", "content": "[fail-mid]"}]})
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert set(error) == {"message", "type", "param", "code"} and "worker crashed" in error["message"]

"""A chat turn's conversation write is never lost silently.

A real conversations process (SQLite) behind the real gateway app over the scripted upstream:
- the service freezes (SIGSTOP) while a reply streams and wakes up a moment later: the gateway
  retries the append with the same idempotency key until it lands, the turn is stored exactly
  once, and [DONE] comes only after it is stored;
- the service dies (SIGKILL) while replies are generated: the stream ends with an SSE error event
  `conversation_not_stored` before [DONE], the whole response is a 503 with that code, each
  failure is counted in llmserve_gateway_conversation_store_failures_total and logged with the
  request id; a new request on the conversation is then refused at once (503 from the history
  read) before anything is generated.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.gateway.harness import GatewayHarness, gateway_config
from tests.gateway.test_overload_and_observability import metric
from tests.reliability.clients import sse_events
from tests.reliability.platform import conversations_proc

FREEZE_S = 1.5
SLOW_REPLY = "[words:20] [slow]"     # 20 tokens, 20 ms apart


@pytest.fixture
def conversations(tmp_path):
    proc = conversations_proc(tmp_path).start()
    try:
        yield proc.wait_ready(120)
    finally:
        if proc.alive():
            os.killpg(proc.pid, signal.SIGCONT)
        proc.stop()


@pytest.fixture
def gateway(tmp_path, conversations):
    cfg = gateway_config(f"sqlite:///{tmp_path / 'g.db'}", conversations.address,
                         conversations={"timeout_s": 0.5, "append_attempts": 6, "append_backoff_s": 0.1})
    with GatewayHarness(cfg) as gw:
        yield gw


def chat(content: str, cid: str, **extra) -> dict:
    return {"model": "fake-model", "conversation_id": cid, "messages": [{"role": "user", "content": content}],
            **extra}


def new_conversation(gw: GatewayHarness, headers: dict) -> str:
    reply = gw.http.post("/v1/conversations", json={"title": "kept"}, headers=headers)
    assert reply.status_code == 201, reply.text
    return reply.json()["id"]


def stream_after_first_token(gw: GatewayHarness, headers: dict, body: dict, then) -> tuple[list, float]:
    """Streams `body`, calls then() once content flows; -> (events, when [DONE] arrived)."""
    text, called = "", False
    with gw.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, headers=headers,
                        timeout=30) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            text += line + "\n"
            if not called and '"content":"w' in line.replace(" ", ""):
                then()
                called = True
    return sse_events(text), time.monotonic()


def test_a_store_that_blinks_gets_the_turn_exactly_once(gateway, conversations):
    headers = {"Authorization": f"Bearer {gateway.new_org('blink')[2]}"}
    cid = new_conversation(gateway, headers)
    woke: list[float] = []

    def wake():
        os.killpg(conversations.pid, signal.SIGCONT)
        woke.append(time.monotonic())

    waker = threading.Timer(FREEZE_S, wake)

    def freeze():
        os.killpg(conversations.pid, signal.SIGSTOP)   # calls now time out; queued ones may land later
        waker.start()

    events, done_at = stream_after_first_token(gateway, headers, chat(SLOW_REPLY, cid), freeze)
    waker.join(30)
    assert events[-1] == "[DONE]" and not [e for e in events if isinstance(e, dict) and "error" in e], events[-3:]
    assert done_at > woke[0], "[DONE] came before the store was back: the turn cannot have been stored"
    stored = gateway.http.get(f"/v1/conversations/{cid}", headers=headers).json()["messages"]
    assert [(m["role"], m["partial"]) for m in stored] == [("user", False), ("assistant", False)]   # once
    assert stored[1]["content"].startswith("w0 w1 ")
    assert metric(gateway.http.get("/metrics").text, "llmserve_gateway_conversation_store_failures_total") == 0


def test_a_turn_that_cannot_be_stored_is_reported(gateway, conversations, caplog):
    caplog.set_level(logging.INFO)
    headers = {"Authorization": f"Bearer {gateway.new_org('lost')[2]}"}
    cid = new_conversation(gateway, headers)

    events, _ = stream_after_first_token(gateway, headers | {"x-request-id": "req-lost-stream"},
                                         chat(SLOW_REPLY, cid), conversations.kill)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert events[-1] == "[DONE]" and len(errors) == 1 and events[-2] is errors[0], events[-3:]
    assert errors[0]["error"]["code"] == "conversation_not_stored" and cid in errors[0]["error"]["message"]
    assert any(isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content")
               for e in events)                                  # the reply itself was streamed

    conversations.start().wait_ready(120)
    deadline = time.monotonic() + 30
    while gateway.http.get(f"/v1/conversations/{cid}", headers=headers).status_code != 200:   # reconnected
        assert time.monotonic() < deadline, "the gateway never reached the restarted conversations service"
        time.sleep(0.2)
    marker = "[words:30] [slow] whole"
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(gateway.http.post, "/v1/chat/completions", json=chat(marker, cid),
                            headers=headers | {"x-request-id": "req-lost-whole"}, timeout=30)
        deadline = time.monotonic() + 10
        while not gateway.fake.find(marker):                     # admitted: the history was read
            assert time.monotonic() < deadline, "the request never reached the upstream"
            time.sleep(0.01)
        conversations.kill()
        reply = whole.result()
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1", reply.text
    assert reply.json()["error"]["code"] == "conversation_not_stored"

    text = gateway.http.get("/metrics").text
    assert metric(text, "llmserve_gateway_conversation_store_failures_total", code="upstream_unavailable") == 2
    logged = [r.getMessage() for r in caplog.records if "NOT stored" in r.getMessage()]
    assert any("req-lost-stream" in m for m in logged) and any("req-lost-whole" in m for m in logged), logged
    assert len([r for r in caplog.records if "retrying" in r.getMessage()]) >= 2 * 5   # 6 attempts each

    calls, started = len(gateway.fake.calls), time.monotonic()   # down at the start: a fast 503, nothing generated
    refused = gateway.http.post("/v1/chat/completions", json=chat("again", cid), headers=headers)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
    assert time.monotonic() - started < 2 and len(gateway.fake.calls) == calls

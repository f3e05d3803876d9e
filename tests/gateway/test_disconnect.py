"""A client that goes away cancels the upstream call at once, before or after the first token, and
its organization is charged for what was produced."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.gateway.harness import GatewayHarness


def send_request(gateway: GatewayHarness, key: str, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    port = int(gateway.base_url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {key}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    seen = b""
    while marker not in seen:
        data = sock.recv(4096)
        assert data, f"connection closed before {marker!r}: {seen!r}"
        seen += data
        assert len(seen) < 12 or seen.startswith(b"HTTP/1.1 200"), seen
    return seen


def wait_for_call(gateway: GatewayHarness, marker: str, before: int):
    deadline = time.monotonic() + 10
    while len(gateway.fake.find(marker)) == before:
        assert time.monotonic() < deadline, "the upstream call never started"
        time.sleep(0.005)
    return gateway.fake.find(marker)[-1]


def assert_cancelled_within_a_second(record, closed_at: float) -> None:
    assert record.finished.wait(5), "the upstream call was never cancelled"
    assert record.cancelled_at is not None, "the upstream call ended without a cancellation"
    assert record.cancelled_at - closed_at < 1.0


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_before_first_token(gateway: GatewayHarness, stream: bool):
    org_id, _, key = gateway.new_org(f"gone-early-{stream}")
    before = len(gateway.fake.find("[hang]"))
    sock = send_request(gateway, key, {"model": "fake-model", "stream": stream,
                                       "messages": [{"role": "user", "content": "[hang]"}]})
    record = wait_for_call(gateway, "[hang]", before)
    if stream:
        assert b": keep-alive" in read_until(sock, b": keep-alive")  # headers and keep-alives flow meanwhile
    closed_at = time.monotonic()
    sock.close()
    assert_cancelled_within_a_second(record, closed_at)
    gateway.drain()
    usage = gateway.call(gateway.gateway.store.list_usage(org_id))
    assert [(u.status, u.completion_tokens) for u in usage] == [("cancelled", 0)]


def test_disconnect_after_first_token_charges_what_was_produced(gateway: GatewayHarness):
    org_id, _, key = gateway.new_org("gone-late", tpm=100_000)
    before = len(gateway.fake.find("[drip]"))
    sock = send_request(gateway, key, {"model": "fake-model", "stream": True, "max_completion_tokens": 2000,
                                       "messages": [{"role": "user", "content": "[drip]"}]})
    read_until(sock, b'"content":"d2 "')
    record = wait_for_call(gateway, "[drip]", before)
    closed_at = time.monotonic()
    sock.close()
    assert_cancelled_within_a_second(record, closed_at)
    gateway.drain()
    [usage] = gateway.call(gateway.gateway.store.list_usage(org_id))
    assert usage.status == "cancelled"
    assert 3 <= usage.completion_tokens <= record.tokens_sent < 2000
    # The reservation (prompt + 2000) was trued up to what was produced: a request needing
    # 100k - produced - prompt tokens still fits, one more does not.
    limiter = gateway.gateway.limiter
    from services.gateway.ratelimit import Limit
    bucket = [Limit(f"org:{org_id}", "tokens", 100_000)]
    spent = usage.prompt_tokens + usage.completion_tokens
    assert not gateway.call(limiter.acquire(bucket, 0, 100_000 - spent + 50)).allowed
    assert gateway.call(limiter.acquire(bucket, 0, 100_000 - spent - 50)).allowed

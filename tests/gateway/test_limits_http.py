"""Rate limits end to end through HTTP: the in-process backend in one gateway, and Redis shared by
two gateway apps (a key with rpm 5 gets exactly 5 of 8 requests through, whichever gateway
answers); headers' values; TPM reservation and refund; Redis down, open or closed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gateway.harness import REDIS_URL, GatewayHarness, gateway_config, redis_key_prefix

OK = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100}


@pytest.fixture(scope="module")
def redis_prefix():
    with redis_key_prefix() as prefix:
        yield prefix


@pytest.fixture(scope="module", params=["memory", "redis"])
def gateways(request, tmp_path_factory, conversations_address):
    """One gateway on the memory backend; two sharing one store and one Redis on the redis backend."""
    db = Path(tmp_path_factory.mktemp("limits")) / "gateway.db"
    limiter = {"backend": request.param}
    if request.param == "redis":
        limiter |= {"redis_url": REDIS_URL, "key_prefix": request.getfixturevalue("redis_prefix")}
    count = 2 if request.param == "redis" else 1
    harnesses = [GatewayHarness(gateway_config(f"sqlite:///{db}", conversations_address, rate_limit=limiter))
                 for _ in range(count)]
    for h in harnesses:
        h.__enter__()
    yield harnesses
    for h in harnesses:
        h.__exit__(None, None, None)


def post(gateway: GatewayHarness, key: str, body: dict = OK):
    return gateway.http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def test_key_rpm_5_lets_exactly_5_of_8_through(gateways):
    _, _, key = gateways[0].new_org("rpm", key_rpm=5)
    replies = [post(gateways[i % len(gateways)], key) for i in range(8)]
    assert [r.status_code for r in replies] == [200] * 5 + [429] * 3
    refused = replies[-1]
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert "Limit 5" in error["message"]
    assert 10_000 <= int(refused.headers["retry-after-ms"]) <= 12_000      # one request per 12 s refills
    assert refused.headers["retry-after"] == str(-(-int(refused.headers["retry-after-ms"]) // 1000))
    assert refused.headers["x-ratelimit-limit-requests"] == "5"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


def test_headers_on_every_response_and_tpm_refund(gateways):
    _, _, key = gateways[0].new_org("headers", rpm=10, tpm=10_000)
    first = post(gateways[0], key)
    assert first.status_code == 200
    h = first.headers
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("10", "9")
    assert h["x-ratelimit-limit-tokens"] == "10000"
    assert int(h["x-ratelimit-remaining-tokens"]) == 10_000 - 106    # estimate 6 + max 100 reserved
    assert h["x-ratelimit-reset-requests"].endswith("s") and h["x-ratelimit-reset-tokens"].endswith(("s", "ms"))
    # The first request used 7 tokens (4 prompt + 3 completion): 99 came back at reconcile.
    second = post(gateways[-1], key)
    remaining = int(second.headers["x-ratelimit-remaining-tokens"])
    assert 10_000 - 7 - 106 <= remaining <= 10_000 - 106, remaining
    assert second.headers["x-ratelimit-remaining-requests"] == "8"


def test_request_larger_than_the_tpm_budget_is_refused_for_good(gateways):
    _, _, key = gateways[0].new_org("tpm", key_tpm=1000)
    whole_context = post(gateways[0], key, {**OK, "max_completion_tokens": None})  # reserves 2048
    assert whole_context.status_code == 429
    assert whole_context.json()["error"]["type"] == "tokens"
    assert whole_context.headers["x-should-retry"] == "false"
    assert post(gateways[0], key, {**OK, "max_completion_tokens": 500}).status_code == 200


@pytest.mark.parametrize("fail_mode, status", [("open", 200), ("closed", 503)])
def test_redis_down(tmp_path, conversations_address, fail_mode, status):
    cfg = gateway_config(f"sqlite:///{tmp_path / 'g.db'}", conversations_address, rate_limit={
        "backend": "redis", "redis_url": "redis://127.0.0.1:1/0", "fail_mode": fail_mode, "redis_timeout_s": 0.1})
    with GatewayHarness(cfg) as gateway:
        _, _, key = gateway.new_org("no-redis", rpm=5)
        reply = post(gateway, key)
        assert reply.status_code == status, reply.text
        metrics = gateway.http.get("/metrics").text
        line = [m for m in metrics.splitlines()
                if m.startswith("llmserve_gateway_ratelimit_backend_errors_total") and fail_mode in m]
        assert line and float(line[0].rsplit(" ", 1)[1]) >= 1

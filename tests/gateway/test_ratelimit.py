"""One behavioural suite for both rate limiter backends, plus what only Redis has: replicas that
share buckets, key layout, and fail-open / fail-closed when Redis is unreachable.

The memory backend runs on a controlled clock, so its numbers are exact; the Redis backend runs on
Redis TIME, so its time-dependent numbers are checked within a tolerance.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from services.gateway.ratelimit import Limit, RateLimitConfig, make_rate_limiter
from services.gateway.ratelimit.memory import MemoryRateLimiter
from services.gateway.ratelimit.redis_backend import RedisRateLimiter, bucket_key

from tests.gateway.harness import REDIS_URL

UNREACHABLE_REDIS_URL = "redis://127.0.0.1:1/0"
TOLERANCE_S = 0.5  # Redis's clock moves while the test runs

ORG = Limit("org:7", "requests", 5)
ORG_TPM = Limit("org:7", "tokens", 1000)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Backend:
    """A backend under test: `replica()` gives another gateway's limiter over the same buckets."""
    kind: str
    prefix: str = ""
    clock: FakeClock | None = None

    def __post_init__(self) -> None:
        self._made = []
        self._memory = MemoryRateLimiter(self.clock) if self.kind == "memory" else None

    def replica(self):
        if self._memory:
            return self._memory  # one process, one set of buckets
        limiter = make_rate_limiter(RateLimitConfig(backend="redis", redis_url=REDIS_URL, key_prefix=self.prefix))
        self._made.append(limiter)
        return limiter

    @property
    def exact(self) -> bool:
        return self.kind == "memory"

    async def close(self) -> None:
        for limiter in self._made:
            await limiter.close()


@pytest.fixture(params=["memory", "redis"])
async def backend(request):
    if request.param == "redis":
        b = Backend("redis", prefix=request.getfixturevalue("redis_prefix"))
    else:
        b = Backend("memory", clock=FakeClock())
    yield b
    await b.close()


def duration_s(text: str) -> float:
    """Parses "12ms", "8.64s", "1m30s", "1h0m0s"."""
    if text.endswith("ms"):
        return int(text[:-2]) / 1000
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?([\d.]+)s", text)
    assert match, text
    hours, minutes, seconds = match.groups()
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(seconds)


def assert_close(actual: float, expected: float, exact: bool) -> None:
    if exact:
        assert actual == pytest.approx(expected, abs=1e-6)
    else:
        assert expected - TOLERANCE_S <= actual <= expected + 1e-3


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---- both backends -------------------------------------------------------------------------------

async def test_rpm_allows_exactly_the_limit(backend):
    limiter = backend.replica()
    decisions = [await limiter.acquire([ORG], 1, 0) for _ in range(8)]
    assert [d.allowed for d in decisions] == [True] * 5 + [False] * 3
    refused = decisions[5]
    assert refused.violated == ORG and not refused.permanent
    assert refused.message.startswith("Rate limit reached for requests per minute (RPM) on org:7: "
                                      "Limit 5, Used 5, Requested 1. Please try again in ")


async def test_concurrent_acquires_never_overshoot(backend):
    limiters = [backend.replica(), backend.replica()]
    decisions = await asyncio.gather(*(limiters[i % 2].acquire([ORG], 1, 0) for i in range(8)))
    assert sum(d.allowed for d in decisions) == 5


async def test_refusal_by_one_limit_spends_no_other(backend):
    limiter = backend.replica()
    org = Limit("org:7", "requests", 10)
    key = Limit("org:7:key:a", "requests", 2)
    decisions = [await limiter.acquire([org, key], 1, 0) for _ in range(3)]
    assert [d.allowed for d in decisions] == [True, True, False]
    assert decisions[2].violated == key
    # The refused third request left the org bucket at 8: another key sees it so.
    other = await limiter.acquire([org, Limit("org:7:key:b", "requests", 2)], 1, 0)
    assert other.allowed
    assert other.headers["x-ratelimit-remaining-requests"] == "1"  # key b, the most restrictive
    only_org = await limiter.acquire([org], 1, 0)
    assert only_org.headers["x-ratelimit-remaining-requests"] == "6"


async def test_refund_restores_reserved_tokens(backend):
    limiter = backend.replica()
    assert (await limiter.acquire([ORG_TPM], 0, 800)).allowed
    assert not (await limiter.acquire([ORG_TPM], 0, 300)).allowed
    await limiter.reconcile([ORG, ORG_TPM], -600)  # the request used 200 of its 800
    after = await limiter.acquire([ORG_TPM], 0, 300)
    assert after.allowed
    assert 500 <= int(after.headers["x-ratelimit-remaining-tokens"]) <= 501


async def test_refund_never_fills_above_capacity(backend):
    limiter = backend.replica()
    await limiter.acquire([ORG_TPM], 0, 100)
    await limiter.reconcile([ORG_TPM], -5000)
    decision = await limiter.acquire([ORG_TPM], 0, 1)
    assert decision.headers["x-ratelimit-remaining-tokens"] == "999"


async def test_charge_creates_debt_that_delays_the_next_request(backend):
    limiter = backend.replica()
    tpm = Limit("org:7", "tokens", 600)  # 10 tokens a second
    assert (await limiter.acquire([tpm], 0, 600)).allowed
    await limiter.reconcile([tpm], 300)  # the request used 300 more than reserved: bucket at -300
    refused = await limiter.acquire([tpm], 0, 1)
    assert not refused.allowed and not refused.permanent
    assert_close(refused.retry_after_s, 30.1, backend.exact)
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    assert_close(duration_s(refused.headers["x-ratelimit-reset-tokens"]), 90.0, backend.exact)
    assert refused.headers["Retry-After"] == "31"


async def test_request_larger_than_the_bucket_is_refused_for_good(backend):
    limiter = backend.replica()
    decision = await limiter.acquire([ORG, ORG_TPM], 1, 1001)
    assert not decision.allowed and decision.permanent
    assert decision.violated == ORG_TPM
    assert decision.headers["x-should-retry"] == "false"
    assert "Retry-After" not in decision.headers
    assert decision.message.startswith("Request too large for tokens per minute (TPM) on org:7: "
                                       "Limit 1000, Requested 1001.")
    whole = await limiter.acquire([ORG, ORG_TPM], 1, 1000)  # the refusal spent nothing
    assert whole.allowed
    assert whole.headers["x-ratelimit-remaining-requests"] == "4"


async def test_headers(backend):
    limiter = backend.replica()
    first = await limiter.acquire([ORG, ORG_TPM], 1, 100)
    assert first.headers["x-ratelimit-limit-requests"] == "5"
    assert first.headers["x-ratelimit-limit-tokens"] == "1000"
    assert first.headers["x-ratelimit-remaining-requests"] == "4"
    assert 900 <= int(first.headers["x-ratelimit-remaining-tokens"]) <= 901
    assert_close(duration_s(first.headers["x-ratelimit-reset-requests"]), 12.0, backend.exact)
    assert_close(duration_s(first.headers["x-ratelimit-reset-tokens"]), 6.0, backend.exact)
    if backend.exact:
        assert first.headers["x-ratelimit-reset-requests"] == "12s"
        assert first.headers["x-ratelimit-reset-tokens"] == "6s"
        assert "Retry-After" not in first.headers
    for _ in range(4):
        await limiter.acquire([ORG, ORG_TPM], 1, 0)
    refused = await limiter.acquire([ORG, ORG_TPM], 1, 0)
    assert not refused.allowed
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["Retry-After"] == "12"
    assert_close(int(refused.headers["retry-after-ms"]) / 1000, 12.0, backend.exact)
    assert_close(refused.retry_after_s, 12.0, backend.exact)
    if backend.exact:
        assert refused.headers["x-ratelimit-reset-requests"] == "1m0s"
        assert refused.headers["retry-after-ms"] == "12000"
        assert refused.message.endswith("Please try again in 12s.")


async def test_bad_calls_are_rejected(backend):
    limiter = backend.replica()
    with pytest.raises(ValueError, match="tokens must be a non-negative integer"):
        await limiter.acquire([ORG_TPM], 1, -1)
    with pytest.raises(ValueError, match="requests must be a non-negative integer"):
        await limiter.acquire([ORG], 1.5, 0)
    with pytest.raises(ValueError, match="same bucket appears twice"):
        await limiter.acquire([ORG, Limit("org:7", "requests", 9)], 1, 0)
    with pytest.raises(ValueError, match="token_delta must be an integer"):
        await limiter.reconcile([ORG_TPM], 2.5)


async def test_no_limits_always_allows(backend):
    decision = await backend.replica().acquire([], 1, 10**9)
    assert decision.allowed and decision.headers == {}


# ---- continuous refill ----------------------------------------------------------------------------

async def test_memory_refills_continuously():
    clock = FakeClock()
    limiter = MemoryRateLimiter(clock)
    for _ in range(5):
        assert (await limiter.acquire([ORG], 1, 0)).allowed
    clock.advance(11.9)
    refused = await limiter.acquire([ORG], 1, 0)
    assert not refused.allowed and refused.retry_after_s == pytest.approx(0.1)
    clock.advance(0.1)
    assert (await limiter.acquire([ORG], 1, 0)).allowed  # one request per 12 s at 5 RPM
    assert not (await limiter.acquire([ORG], 1, 0)).allowed


async def test_memory_forgets_full_buckets_but_keeps_debts():
    clock = FakeClock()
    limiter = MemoryRateLimiter(clock)
    await limiter.acquire([ORG], 1, 0)
    await limiter.acquire([ORG_TPM], 0, 1000)
    await limiter.reconcile([ORG_TPM], 60_000)  # an hour of debt
    clock.advance(61)
    assert not (await limiter.acquire([ORG_TPM], 0, 1)).allowed
    assert list(limiter._buckets) == [("org:7", "tokens")]  # the refilled requests bucket is gone


async def test_redis_refills_continuously(redis_prefix):
    limiter = RedisRateLimiter(RateLimitConfig(backend="redis", redis_url=REDIS_URL, key_prefix=redis_prefix))
    fast = Limit("org:7", "requests", 600)  # 10 a second
    try:
        assert (await limiter.acquire([fast], 600, 0)).allowed
        refused = await limiter.acquire([fast], 1, 0)
        assert not refused.allowed and 0 < refused.retry_after_s <= 0.1
        await asyncio.sleep(0.15)
        assert (await limiter.acquire([fast], 1, 0)).allowed
        assert not (await limiter.acquire([fast], 1, 0)).allowed
    finally:
        await limiter.close()


# ---- Redis only ------------------------------------------------------------------------------------

async def test_two_replicas_share_one_budget(redis_prefix):
    cfg = RateLimitConfig(backend="redis", redis_url=REDIS_URL, key_prefix=redis_prefix)
    replicas = [RedisRateLimiter(cfg), RedisRateLimiter(cfg)]  # separate connection pools
    try:
        decisions = await asyncio.gather(*(replicas[i % 2].acquire([ORG, ORG_TPM], 1, 10) for i in range(8)))
        assert sum(d.allowed for d in decisions) == 5
        assert sum(d.allowed for d in decisions[0::2]) >= 1 and sum(d.allowed for d in decisions[1::2]) >= 1
    finally:
        for replica in replicas:
            await replica.close()


async def test_redis_keys_share_the_org_hash_tag_and_expire(redis_prefix):
    key_limit = Limit("org:7:key:a", "tokens", 600)
    assert bucket_key(redis_prefix, key_limit) == f"{redis_prefix}{{org:7}}:key:a:tokens"
    assert bucket_key(redis_prefix, ORG) == f"{redis_prefix}{{org:7}}:requests"
    limiter = RedisRateLimiter(RateLimitConfig(backend="redis", redis_url=REDIS_URL, key_prefix=redis_prefix))
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await limiter.acquire([ORG, key_limit], 1, 60)
        ttl_ms = await client.pttl(bucket_key(redis_prefix, key_limit))
        assert 60_000 < ttl_ms <= 66_000  # a minute after the 6 s it takes to refill 60 tokens
        stored = await client.hgetall(bucket_key(redis_prefix, ORG))
        assert float(stored[b"tokens"]) == pytest.approx(4.0, abs=0.01)
    finally:
        await limiter.close()
        await client.aclose()


@pytest.mark.parametrize("fail_mode", ["open", "closed"])
async def test_unreachable_redis_applies_the_fail_mode(fail_mode, caplog):
    limiter = make_rate_limiter(RateLimitConfig(backend="redis", redis_url=UNREACHABLE_REDIS_URL,
                                                fail_mode=fail_mode, redis_timeout_s=0.5))
    errors_before = counter("llmserve_gateway_ratelimit_backend_errors_total", mode=fail_mode)
    result = "degraded" if fail_mode == "open" else "unavailable"
    decisions_before = counter("llmserve_gateway_ratelimit_decisions_total", result=result, dimension="none")
    try:
        decision = await limiter.acquire([ORG, ORG_TPM], 1, 10)
        await limiter.reconcile([ORG_TPM], 5)  # never raises at the end of a request
    finally:
        await limiter.close()
    if fail_mode == "open":
        assert decision.allowed and decision.degraded and not decision.unavailable
    else:
        assert not decision.allowed and decision.unavailable and not decision.degraded
        assert decision.violated is None and not decision.permanent
        assert "unavailable" in decision.message and decision.headers["Retry-After"] == "1"
    assert counter("llmserve_gateway_ratelimit_backend_errors_total", mode=fail_mode) == errors_before + 2
    warnings = [r for r in caplog.records if "rate limiter: Redis" in r.getMessage()]
    assert len(warnings) == 1  # an outage does not flood the log
    assert counter("llmserve_gateway_ratelimit_decisions_total", result=result, dimension="none") \
        == decisions_before + 1


async def test_decisions_are_counted(backend):
    limiter = backend.replica()
    labels = [("allowed", "none"), ("limited", "requests"), ("too_large", "tokens")]
    before = [counter("llmserve_gateway_ratelimit_decisions_total", result=r, dimension=d) for r, d in labels]
    for _ in range(6):
        await limiter.acquire([ORG], 1, 0)
    await limiter.acquire([ORG_TPM], 0, 5000)
    after = [counter("llmserve_gateway_ratelimit_decisions_total", result=r, dimension=d) for r, d in labels]
    assert [a - b for a, b in zip(after, before)] == [5, 1, 1]


async def test_a_redis_that_never_answers_times_out_into_the_fail_mode():
    connections: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)  # accepts the connection, never replies

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limiter = RedisRateLimiter(RateLimitConfig(backend="redis", redis_url=f"redis://127.0.0.1:{port}/0",
                                               fail_mode="open", redis_timeout_s=0.2))
    errors_before = counter("llmserve_gateway_ratelimit_backend_errors_total", mode="open")
    try:
        decision = await limiter.acquire([ORG], 1, 0)
    finally:
        await limiter.close()
        server.close()
        for writer in connections:
            writer.close()
        await server.wait_closed()
    assert decision.allowed and decision.degraded
    assert counter("llmserve_gateway_ratelimit_backend_errors_total", mode="open") == errors_before + 1

"""The gateway's in-flight limit follows the pool's routable workers: with follow_pool_load off (so
the measured speeds do not set it), max_in_flight_per_worker x the model's routable workers as the
router reports them. A gateway process with one stream per worker and no queue, in
front of the platform's router and two workers: two streams are admitted and a third is refused
at once; with one worker drained by the admin, one stream and the second refused; undrained, two
again."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import httpx
import pytest

from tests.gateway.test_overload_and_observability import metric
from tests.reliability.clients import Admin, chat_body, set_draining
from tests.reliability.platform import MODEL, Proc, gateway_proc, start_all
from tests.reliability.test_faults import SseStream

LONG = 200   # tokens: the admitted streams are still running when the next request comes


@pytest.fixture
def pool_gateway(platform, tmp_path):
    gateway = gateway_proc("gateway-pool", tmp_path, platform.router.address, platform.conversations.address,
                           f"sqlite:///{tmp_path / 'gateway.db'}", overload__follow_pool_load="false",
                           overload__max_in_flight_per_worker="1",
                           overload__min_in_flight_per_model="1", overload__max_in_flight_per_model="8",
                           overload__max_queued_per_model="0", overload__workers_poll_s="0.2")
    start_all([gateway])
    try:
        yield gateway
    finally:
        gateway.stop()


def gauge(gateway: Proc, name: str) -> float:
    return metric(httpx.get(gateway.address + "/metrics", timeout=10).text, name, model=MODEL)


def wait_gauge(gateway: Proc, name: str, expected: float, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while (value := gauge(gateway, name)) != expected:
        assert time.monotonic() < deadline, f"{name} is {value}, expected {expected}"
        time.sleep(0.1)


async def admits_exactly(gateway: Proc, secret: str, n: int) -> None:
    """n streams are admitted (each past its first token) and the next request is refused at once."""
    url = gateway.address + "/v1/chat/completions"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {secret}"},
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        # ignore_eos: a stream that ended early would free its slot (CI once admitted the next)
        streams = [SseStream(session, url, chat_body(f"Tell story number {i}.", LONG, stream=True, ignore_eos=True))
                   for i in range(n)]
        try:
            for s in streams:
                await s.first_token()
            started = time.monotonic()
            async with session.post(url, json=chat_body("One more?", 2)) as refused:
                body = await refused.json()
            assert refused.status == 429 and body["error"]["code"] == "overloaded", body
            assert time.monotonic() - started < 1
        finally:
            for s in streams:
                if s.response is not None:
                    s.response.close()
    await asyncio.to_thread(wait_gauge, gateway, "llmserve_gateway_in_flight_requests", 0)


async def test_the_in_flight_limit_follows_the_routable_workers(platform, pool_gateway):
    router, spare = platform.router.address, platform.workers[1].address
    secret = Admin(pool_gateway.address).new_org("pool-limit")[2]
    wait_gauge(pool_gateway, "llmserve_gateway_overload_limit", 2)
    await admits_exactly(pool_gateway, secret, 2)
    set_draining(router, spare, True)
    try:
        wait_gauge(pool_gateway, "llmserve_gateway_overload_limit", 1)
        await admits_exactly(pool_gateway, secret, 1)
    finally:
        set_draining(router, spare, False)
    wait_gauge(pool_gateway, "llmserve_gateway_overload_limit", 2)
    await admits_exactly(pool_gateway, secret, 2)

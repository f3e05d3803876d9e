"""A storm of clients that go away at random points, over several rounds.

After every round: nothing runs or waits on any worker and every KV block is back in the pool;
after the gateway storm the gateway's and the router's in-flight counts are back to 0.
Across rounds: the worker's (and gateway's) resident memory, threads and file descriptors stay
within a bound of the first round's, so nothing leaks per cancelled request. CI runs a short
storm; `make test-soak` runs the long one (marked slow).
"""

from __future__ import annotations

import asyncio
import random
import urllib.request
from dataclasses import dataclass

import aiohttp
import grpc
import pytest

from llmserve.v1 import worker_pb2_grpc
from tests.reliability.clients import Admin, chat_body, chat_request, router_workers, wait_idle
from tests.reliability.platform import Platform, Proc

RSS_GROWTH_BOUND_KB = 96 * 1024    # allocator noise and caches warm up; a per-request leak exceeds it
FD_GROWTH_BOUND = 8


@dataclass(frozen=True)
class Storm:
    rounds: int
    clients: int
    max_tokens: int


CI_STORM = Storm(rounds=3, clients=8, max_tokens=16)
SOAK_STORM = Storm(rounds=8, clients=24, max_tokens=32)


def cancel_points(rng: random.Random, n: int, max_tokens: int) -> list[int | None]:
    """Per client: -1 leaves before any answer, k leaves after k messages, None reads to the end."""
    return [rng.choice([-1, 0, 1, 2, rng.randrange(1, max_tokens), None]) for _ in range(n)]


async def grpc_client(stub, i: int, leave_after: int | None, max_tokens: int, rng: random.Random) -> None:
    call = stub.Generate(chat_request(f"Storm client {i}: tell me about the number {rng.randrange(10**6)}.",
                                      max_tokens, ignore_eos=True), timeout=120)
    if leave_after == -1:
        await asyncio.sleep(rng.uniform(0, 0.2))
        call.cancel()
        return
    received = 0
    async for _ in call:
        received += 1
        if leave_after is not None and received > leave_after:
            call.cancel()
            return


async def http_client(session: aiohttp.ClientSession, url: str, i: int, leave_after: int | None, max_tokens: int,
                      rng: random.Random) -> None:
    body = chat_body(f"Storm client {i}: describe the number {rng.randrange(10**6)}.", max_tokens, stream=True)
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        if leave_after == -1:
            await asyncio.sleep(rng.uniform(0, 0.2))
            response.close()   # drops the connection: the gateway must abort upstream
            return
        chunks = 0
        async for _ in response.content:
            chunks += 1
            if leave_after is not None and chunks > leave_after:
                response.close()
                return


def footprint(procs: list[Proc]) -> dict[str, dict[str, int]]:
    return {p.name: p.status() for p in procs}


def assert_bounded(first: dict[str, dict[str, int]], last: dict[str, dict[str, int]]) -> None:
    print(f"\nfootprint after the first round: {first}\nafter the last round: {last}")   # for docs/reliability.md
    for name, before in first.items():
        after = last[name]
        assert after["rss_kb"] - before["rss_kb"] < RSS_GROWTH_BOUND_KB, f"{name} memory grew: {before} -> {after}"
        assert after["threads"] <= before["threads"] + 2, f"{name} threads grew: {before} -> {after}"
        assert after["fds"] <= before["fds"] + FD_GROWTH_BOUND, f"{name} descriptors grew: {before} -> {after}"


async def storm_worker_directly(worker: Proc, storm: Storm, seed: int) -> list[dict]:
    rng = random.Random(seed)
    footprints = []
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.GenerationStub(channel)
        for _ in range(storm.rounds):
            points = cancel_points(rng, storm.clients, storm.max_tokens)
            await asyncio.wait_for(asyncio.gather(*(grpc_client(stub, i, p, storm.max_tokens, rng)
                                                    for i, p in enumerate(points))), 300)
            await asyncio.to_thread(wait_idle, worker.address)
            footprints.append(footprint([worker]))
    return footprints


async def storm_through_gateway(platform: Platform, secret: str, storm: Storm, seed: int) -> list[dict]:
    rng = random.Random(seed)
    url = platform.gateway_url + "/v1/chat/completions"
    footprints = []
    headers = {"Authorization": f"Bearer {secret}"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=300)) as session:
        for _ in range(storm.rounds):
            points = cancel_points(rng, storm.clients, storm.max_tokens)
            await asyncio.wait_for(asyncio.gather(*(http_client(session, url, i, p, storm.max_tokens, rng)
                                                    for i, p in enumerate(points))), 300)
            for w in platform.workers:
                await asyncio.to_thread(wait_idle, w.address)
            footprints.append(footprint([platform.gateways[0], platform.router, *platform.workers]))
    return footprints


async def run_worker_storm(platform: Platform, storm: Storm) -> None:
    footprints = await storm_worker_directly(platform.workers[0], storm, seed=8)
    assert_bounded(footprints[0], footprints[-1])


async def run_gateway_storm(platform: Platform, storm: Storm) -> None:
    secret = Admin(platform.gateway_url).new_org(f"storm-{storm.rounds}")[2]
    footprints = await storm_through_gateway(platform, secret, storm, seed=9)
    assert_bounded(footprints[0], footprints[-1])
    metrics = await asyncio.to_thread(_metrics, platform.gateway_url)
    assert 'gateway_in_flight_requests{model="smollm2-135m-instruct"} 0.0' in metrics
    workers = await asyncio.to_thread(router_workers, platform.router.address)
    assert [w.in_flight for w in workers.values()] == [0] * len(platform.workers)   # the router's own count


def _metrics(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        return r.read().decode()


async def test_worker_disconnect_storm(platform):
    await run_worker_storm(platform, CI_STORM)


async def test_gateway_disconnect_storm(platform):
    await run_gateway_storm(platform, CI_STORM)


@pytest.mark.slow
async def test_worker_disconnect_storm_soak(platform):
    await run_worker_storm(platform, SOAK_STORM)


@pytest.mark.slow
async def test_gateway_disconnect_storm_soak(platform):
    await run_gateway_storm(platform, SOAK_STORM)

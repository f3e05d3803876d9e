"""Malformed and random GenerateRequests against a real worker and a real router.

Every call must end within its deadline with OK or a caller's-fault status (INVALID_ARGUMENT,
NOT_FOUND); bytes that do not decode as a GenerateRequest get grpc.aio's own
UNKNOWN "Unexpected <class 'google.protobuf.message.DecodeError'>..." before any of our code runs
(the library answers it; a servicer cannot turn it into INVALID_ARGUMENT). Afterwards the server still
answers, nothing is left running, and every KV block is back.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.v1 import worker_pb2, worker_pb2_grpc
from tests.reliability.clients import chat_request, wait_idle
from tests.reliability.grpc_fuzz import random_bytes, random_request, send_raw

CALLER_FAULTS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
UNDECODABLE = (grpc.StatusCode.UNKNOWN, "Unexpected <class 'google.protobuf.message.DecodeError'>")
DEADLINE_S = 60
CONCURRENCY = 8
ENOUGH_MESSAGES = 8


async def outcome(call) -> tuple[grpc.StatusCode, str]:
    """How the call ended. A valid request may ask for many tokens (mangled bytes can drop
    max_tokens): once it has streamed a few messages it is alive, not hung, and is cancelled."""
    received = 0
    try:
        async for _ in call:
            received += 1
            if received >= ENOUGH_MESSAGES:
                call.cancel()
                break
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""


async def fuzz(address: str, seed: int, num_requests: int, num_raw: int) -> Counter:
    rng = random.Random(seed)
    seen: Counter = Counter()
    bad: list[str] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.GenerationStub(channel)

        async def one(i: int) -> None:
            if i < num_requests:
                request = random_request(rng)
                code, details = await outcome(stub.Generate(request, timeout=DEADLINE_S))
                ok = code in CALLER_FAULTS
                what = str(request)[:300]
            else:
                payload = random_bytes(rng)
                code, details = await outcome(send_raw(channel, payload, DEADLINE_S))
                ok = code in CALLER_FAULTS or (code == UNDECODABLE[0] and details.startswith(UNDECODABLE[1]))
                what = payload[:64].hex()
            seen[code.name] += 1
            if not ok:
                bad.append(f"{code.name} {details!r} for {what}")

        total = num_requests + num_raw
        for start in range(0, total, CONCURRENCY):
            await asyncio.gather(*(one(i) for i in range(start, min(start + CONCURRENCY, total))))

        assert not bad, f"{len(bad)} calls ended badly, e.g.:\n" + "\n".join(bad[:10])
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = [r async for r in stub.Generate(chat_request("Still there?", 2), timeout=DEADLINE_S)]
        assert replies[-1].finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED
    assert seen["INVALID_ARGUMENT"] > 0 and seen["OK"] > 0, seen   # the fuzz reached both outcomes
    return seen


@pytest.mark.parametrize("target", ["worker", "router"])
async def test_fuzzed_generate_requests_get_clear_refusals(platform, target):
    address = platform.workers[0].address if target == "worker" else platform.router.address
    await fuzz(address, seed=1, num_requests=120, num_raw=60)
    for w in platform.workers:
        await asyncio.to_thread(wait_idle, w.address)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["worker", "router"])
async def test_fuzzed_generate_requests_soak(platform, target):
    address = platform.workers[0].address if target == "worker" else platform.router.address
    await fuzz(address, seed=2, num_requests=1500, num_raw=1000)
    for w in platform.workers:
        await asyncio.to_thread(wait_idle, w.address)

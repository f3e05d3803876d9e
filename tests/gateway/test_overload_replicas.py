"""Gateway replicas share the pool's overload budget (services/gateway/replicas.py): heartbeats in
the real Redis count the live replicas, each admits its share, a replica that closes or goes
silent stops counting, and a Redis outage keeps the last count."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from llmserve.v1 import router_pb2, worker_pb2
from services.gateway.config import OverloadConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.overload import OverloadGuard
from services.gateway.pool_watch import PoolWatch
from services.gateway.ratelimit import RateLimitConfig
from services.gateway.replicas import RedisReplicas, Replicas, make_replicas
from tests.gateway.harness import REDIS_URL


def guard() -> OverloadGuard:
    return OverloadGuard(OverloadConfig(max_in_flight_per_worker=2, min_in_flight_per_model=1,
                                        max_in_flight_per_model=64), GatewayMetrics())


def test_each_replica_admits_its_share_rounded_up_within_the_floor():
    g = guard()
    for replicas, limit in ((1, 6), (2, 3), (4, 2), (6, 1), (50, 1)):
        g.set_workers({"m": 3}, replicas=replicas)     # budget 2 x 3 workers = 6
        assert g.limit("m") == limit


def replicas(prefix: str, ttl_s: float = 30.0) -> RedisReplicas:
    return RedisReplicas(REDIS_URL, f"{prefix}gateways", ttl_s=ttl_s, timeout_s=1.0)


async def test_replicas_count_each_other_and_leave_on_close(redis_prefix):
    a, b = replicas(redis_prefix), replicas(redis_prefix)
    try:
        assert await a.beat() == 1
        assert await b.beat() == 2
        assert await a.beat() == 2
    finally:
        await b.close()
    try:
        assert await a.beat() == 1
    finally:
        await a.close()


async def test_a_silent_replica_stops_counting_after_its_ttl(redis_prefix):
    alive, crashed = replicas(redis_prefix, ttl_s=0.5), replicas(redis_prefix, ttl_s=0.5)
    try:
        await crashed.beat()
        assert await alive.beat() == 2
        await asyncio.sleep(0.7)                 # `crashed` never beats again, never says goodbye
        assert await alive.beat() == 1
    finally:
        await alive.close()
        await crashed.close()


async def test_a_redis_outage_keeps_the_last_count(redis_prefix, monkeypatch):
    a, b = replicas(redis_prefix), replicas(redis_prefix)
    try:
        await a.beat()
        assert await b.beat() == 2

        async def down(**_):
            raise RedisConnectionError("Connection refused")

        monkeypatch.setattr(b, "_script", down)
        assert await b.beat() == 2
    finally:
        await a.close()
        await b.close()
    unreachable = RedisReplicas("redis://127.0.0.1:1/0", "llmserve:gateways", ttl_s=1.0, timeout_s=0.2)
    assert await unreachable.beat() == 1      # never reached: alone, not zero
    await unreachable.close()


def test_only_the_redis_backend_shares_the_budget():
    assert type(make_replicas(RateLimitConfig(backend="memory"), beat_s=2.0)) is Replicas
    shared = make_replicas(RateLimitConfig(backend="redis", redis_url=REDIS_URL, key_prefix="p:"), beat_s=2.0)
    assert isinstance(shared, RedisReplicas) and shared._key == "p:gateways" and shared._ttl_s == 7.0


class _Router:
    """The router's ListWorkers answer: three routable workers of model m."""

    async def list_workers(self, model: str = "") -> list[router_pb2.WorkerStatus]:
        return [router_pb2.WorkerStatus(model="m", address=f"w{i}", healthy=True, load=worker_pb2.LoadReport())
                for i in range(3)]


async def test_two_gateways_polling_the_pool_split_its_budget(redis_prefix):
    guards = [guard(), guard()]
    watches = [PoolWatch(_Router(), g, replicas(redis_prefix), interval_s=60) for g in guards]
    try:
        for watch in watches:
            assert await watch.poll()
        await watches[0].poll()                  # the first now sees the second
        assert [g.limit("m") for g in guards] == [3, 3]
    finally:
        await watches[1].close()
    try:
        await watches[0].poll()
        assert guards[0].limit("m") == 6          # alone again
    finally:
        await watches[0].close()

"""How many gateway replicas share the workers, so that each admits its share of the overload budget.

With the Redis rate-limit backend every replica keeps a heartbeat in one sorted set (member: its
id, score: Redis's clock, so replicas' clocks never matter): a beat records this replica, prunes
members silent for ttl_s and counts the rest. A replica removes itself when it closes; one that
crashed drops out after ttl_s. Without Redis a gateway counts itself alone. A failed beat keeps
the last count: the budget neither doubles nor collapses while Redis is away.
"""

from __future__ import annotations

import contextlib
import logging
import uuid

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.gateway.ratelimit.base import RateLimitConfig

log = logging.getLogger(__name__)

_BEAT = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1000000
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], t, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', t - ttl)
redis.call('EXPIRE', KEYS[1], math.ceil(ttl) * 2)
return redis.call('ZCARD', KEYS[1])
"""
_FAILURES = (RedisError, OSError, TimeoutError)


class Replicas:
    """A gateway alone."""

    async def beat(self) -> int:
        return 1

    async def close(self) -> None:
        pass


class RedisReplicas(Replicas):
    def __init__(self, redis_url: str, key: str, ttl_s: float, timeout_s: float):
        self.id = uuid.uuid4().hex
        self._key, self._ttl_s = key, ttl_s
        self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=timeout_s,
                                              socket_connect_timeout=timeout_s)
        self._script = self._redis.register_script(_BEAT)
        self._count = 1
        self._failing = False

    async def beat(self) -> int:
        try:
            self._count = max(1, int(await self._script(keys=[self._key], args=[self.id, self._ttl_s])))
        except _FAILURES as e:
            if not self._failing:
                log.warning("gateway heartbeat to Redis failed (%s); keeping %d replicas", type(e).__name__, self._count)
            self._failing = True
            return self._count
        if self._failing:
            log.info("gateway heartbeat to Redis resumed: %d replicas", self._count)
        self._failing = False
        return self._count

    async def close(self) -> None:
        with contextlib.suppress(*_FAILURES):
            await self._redis.zrem(self._key, self.id)
        await self._redis.aclose()


def make_replicas(rate_limit: RateLimitConfig, beat_s: float) -> Replicas:
    """Replicas that share the Redis rate limiter share the budget; a beat every beat_s, and a
    replica silent for three beats (plus a second) no longer counts."""
    if rate_limit.backend != "redis":
        return Replicas()
    return RedisReplicas(rate_limit.redis_url, f"{rate_limit.key_prefix}gateways", ttl_s=3 * beat_s + 1,
                         timeout_s=rate_limit.redis_timeout_s)

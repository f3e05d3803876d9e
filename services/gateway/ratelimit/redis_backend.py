"""Token buckets in Redis, shared by every gateway replica.

All bucket changes happen inside token_bucket.lua, on Redis's clock, so replicas never race and
clocks never skew. Key layout: <prefix>{<first two scope segments>}[:<rest of scope>]:<dimension>,
e.g. llmserve:rl:{org:7}:key:k1:tokens. The braces are a Redis Cluster hash tag: callers build
every scope of one request under its org ("org:7", "org:7:key:k1"), so one script call touches
one slot. On a single Redis any scopes work.

When Redis fails or exceeds `redis_timeout_s`, `fail_mode` decides: open lets the request through
(Decision.degraded), closed refuses it (Decision.unavailable, answer 503). Both are counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Sequence

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from .base import Decision, Limit, RateLimitConfig, validate_reconcile, validate_request
from .decision import BucketOutcome, decide, degraded, unavailable
from .metrics import BACKEND_ERRORS, count_decision

log = logging.getLogger(__name__)

SCRIPT = (Path(__file__).parent / "token_bucket.lua").read_text()
WARN_EVERY_S = 10.0
BACKEND_FAILURES = (RedisError, OSError, TimeoutError)


def bucket_key(prefix: str, limit: Limit) -> str:
    """The scope's first two segments become the hash tag: llmserve:rl:{org:7}:key:k1:tokens."""
    parts = limit.scope.split(":", 2)
    return ":".join([f"{prefix}{{{':'.join(parts[:2])}}}", *parts[2:], limit.dimension])


class RedisRateLimiter:
    def __init__(self, cfg: RateLimitConfig) -> None:
        self._cfg = cfg
        # One quick retry (a pooled connection may be stale after a Redis restart), never a backoff:
        # the whole call must fit in redis_timeout_s.
        self._redis = aioredis.Redis.from_url(
            cfg.redis_url, socket_timeout=cfg.redis_timeout_s, socket_connect_timeout=cfg.redis_timeout_s,
            retry=Retry(NoBackoff(), 1))
        self._script = self._redis.register_script(SCRIPT)
        self._last_warning = -WARN_EVERY_S
        self._unlogged_errors = 0

    async def acquire(self, limits: Sequence[Limit], requests: int, tokens: int) -> Decision:
        validate_request(limits, requests, tokens)
        costs = [limit.cost(requests, tokens) for limit in limits]
        try:
            reply = await self._run("acquire", limits, costs) if limits else [1]
        except BACKEND_FAILURES as e:
            self._failed(e)
            return count_decision(degraded() if self._cfg.fail_mode == "open" else unavailable())
        outcomes = [BucketOutcome(limit, cost, float(level)) for limit, cost, level in zip(limits, costs, reply[1:])]
        return count_decision(decide(outcomes, allowed=int(reply[0]) == 1))

    async def reconcile(self, limits: Sequence[Limit], token_delta: int) -> None:
        validate_reconcile(limits, token_delta)
        token_limits = [limit for limit in limits if limit.dimension == "tokens"]
        if not token_limits or token_delta == 0:
            return
        try:
            await self._run("reconcile", token_limits, [token_delta] * len(token_limits))
        except BACKEND_FAILURES as e:
            self._failed(e)

    async def close(self) -> None:
        await self._redis.aclose()

    async def _run(self, mode: str, limits: Sequence[Limit], amounts: Sequence[int]) -> list:
        args: list[str | int] = [mode]
        for limit, amount in zip(limits, amounts):
            args += [limit.per_minute, amount]
        keys = [bucket_key(self._cfg.key_prefix, limit) for limit in limits]
        async with asyncio.timeout(self._cfg.redis_timeout_s):
            return await self._script(keys=keys, args=args)

    def _failed(self, error: BaseException) -> None:
        BACKEND_ERRORS.labels(mode=self._cfg.fail_mode).inc()
        self._unlogged_errors += 1
        now = time.monotonic()
        if now - self._last_warning >= WARN_EVERY_S:  # an outage must not flood the log
            log.warning("rate limiter: Redis at %s failed %d time(s) (fail-%s), last: %r",
                        self._cfg.redis_url, self._unlogged_errors, self._cfg.fail_mode, error)
            self._last_warning, self._unlogged_errors = now, 0

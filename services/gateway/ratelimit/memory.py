"""In-process token buckets: the embedded default for one gateway process.

Every method runs without awaiting between reading and writing buckets, so on one event loop each
call is atomic, like the Redis script. Same semantics as token_bucket.lua, on a monotonic clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .base import Decision, Limit, validate_reconcile, validate_request
from .decision import BucketOutcome, can_pay, decide
from .metrics import count_decision

SWEEP_EVERY_S = 60.0  # forget full buckets this often: a missing bucket is a full one


@dataclass
class _Bucket:
    level: float
    ts: float
    per_minute: int

    def level_at(self, now: float) -> float:
        return min(float(self.per_minute), self.level + max(0.0, now - self.ts) * self.per_minute / 60)


class MemoryRateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._last_sweep = clock()

    async def acquire(self, limits: Sequence[Limit], requests: int, tokens: int) -> Decision:
        validate_request(limits, requests, tokens)
        now = self._clock()
        self._sweep(now)
        buckets = [self._refilled(limit, now) for limit in limits]
        costs = [limit.cost(requests, tokens) for limit in limits]
        allowed = all(can_pay(b.level, c) for b, c in zip(buckets, costs))
        if allowed:
            for bucket, cost in zip(buckets, costs):
                bucket.level -= cost
        outcomes = [BucketOutcome(limit, cost, bucket.level)
                    for limit, cost, bucket in zip(limits, costs, buckets)]
        return count_decision(decide(outcomes, allowed))

    async def reconcile(self, limits: Sequence[Limit], token_delta: int) -> None:
        validate_reconcile(limits, token_delta)
        now = self._clock()
        for limit in limits:
            if limit.dimension == "tokens":
                bucket = self._refilled(limit, now)
                bucket.level = min(float(limit.per_minute), bucket.level - token_delta)

    async def close(self) -> None:
        self._buckets.clear()

    def _refilled(self, limit: Limit, now: float) -> _Bucket:
        bucket = self._buckets.setdefault((limit.scope, limit.dimension),
                                          _Bucket(limit.per_minute, now, limit.per_minute))
        bucket.per_minute = limit.per_minute
        bucket.level, bucket.ts = bucket.level_at(now), now
        return bucket

    def _sweep(self, now: float) -> None:
        if now - self._last_sweep < SWEEP_EVERY_S:
            return
        self._last_sweep = now
        self._buckets = {k: b for k, b in self._buckets.items() if b.level_at(now) < b.per_minute}

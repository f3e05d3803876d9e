"""Turns bucket levels into a Decision: the wait, the headers and the message.

Both backends end here, so they report identically: the memory backend from its own buckets, the
Redis backend from the levels its Lua script returns (all read at one instant of Redis TIME).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .base import Decision, Limit
from .headers import NO_RETRY, bucket_headers, format_duration, retry_headers

EPSILON = 1e-9  # float noise in refill arithmetic; the Lua script uses the same tolerance

_NAMES = {"requests": "requests per minute (RPM)", "tokens": "tokens per minute (TPM)"}


@dataclass(frozen=True)
class BucketOutcome:
    limit: Limit
    cost: int
    level: float  # units in the bucket after the decision (before it when refused); negative is debt

    @property
    def seconds_per_unit(self) -> float:
        return 60 / self.limit.per_minute

    @property
    def wait_s(self) -> float:
        """Time until this bucket can pay its cost."""
        return max(0.0, self.cost - self.level) * self.seconds_per_unit

    @property
    def reset_s(self) -> float:
        """Time until this bucket is full again."""
        return max(0.0, self.limit.per_minute - self.level) * self.seconds_per_unit

    @property
    def remaining(self) -> int:
        return max(0, math.floor(self.level + EPSILON))

    @property
    def used(self) -> int:
        return max(0, math.ceil(self.limit.per_minute - self.level - EPSILON))


def can_pay(level: float, cost: int) -> bool:
    return level + EPSILON >= cost


def decide(outcomes: Sequence[BucketOutcome], allowed: bool) -> Decision:
    headers = _limit_headers(outcomes)
    if allowed:
        return Decision(True, False, 0.0, None, headers, "")
    too_large = [o for o in outcomes if o.cost > o.limit.per_minute]
    if too_large:
        o = too_large[0]
        message = (f"Request too large for {_NAMES[o.limit.dimension]} on {o.limit.scope}: "
                   f"Limit {o.limit.per_minute}, Requested {o.cost}. "
                   f"Reduce the request's size to run it.")
        return Decision(False, True, 0.0, o.limit, headers | NO_RETRY, message)
    o = max(outcomes, key=lambda o: o.wait_s)  # all buckets can pay once the slowest one can
    message = (f"Rate limit reached for {_NAMES[o.limit.dimension]} on {o.limit.scope}: "
               f"Limit {o.limit.per_minute}, Used {o.used}, Requested {o.cost}. "
               f"Please try again in {format_duration(o.wait_s)}.")
    return Decision(False, False, o.wait_s, o.limit, headers | retry_headers(o.wait_s), message)


def _limit_headers(outcomes: Sequence[BucketOutcome]) -> dict[str, str]:
    """Per dimension, the most restrictive bucket: least remaining, then the longest reset."""
    headers: dict[str, str] = {}
    for dimension in ("requests", "tokens"):
        mine = [o for o in outcomes if o.limit.dimension == dimension]
        if mine:
            o = min(mine, key=lambda o: (o.remaining, -o.reset_s))
            headers |= bucket_headers(dimension, o.limit.per_minute, o.remaining, o.reset_s)
    return headers


def degraded() -> Decision:
    """Fail-open: the backend is unreachable and the request goes through unmetered."""
    return Decision(True, False, 0.0, None, {}, "", degraded=True)


def unavailable(retry_after_s: float = 1.0) -> Decision:
    """Fail-closed: the backend is unreachable and the request is refused (HTTP 503)."""
    return Decision(False, False, retry_after_s, None, retry_headers(retry_after_s),
                    "The rate limiter is unavailable; please try again shortly.", unavailable=True)

"""The rate limiter's interface: token-bucket limits in, an all-or-nothing decision out.

Each Limit is one token bucket holding at most `per_minute` units, refilled continuously at
per_minute / 60 a second. A request costs `requests` units in every requests bucket and `tokens`
units in every tokens bucket; it passes only if every bucket can pay, and then pays in all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

DIMENSIONS = ("requests", "tokens")


@dataclass(frozen=True)
class Limit:
    """One token bucket. Scopes are built by callers: "org:<id>", "org:<id>:key:<k>",
    "org:<id>:key:<k>:model:<m>". On Redis the first two segments of a scope are its hash tag, so
    scopes that begin with the org keep one request's buckets in one Cluster slot."""
    scope: str
    dimension: str  # "requests" | "tokens"
    per_minute: int

    def __post_init__(self) -> None:
        if not self.scope or "{" in self.scope or "}" in self.scope:  # braces would break the Redis hash tag
            raise ValueError(f"rate limit scope must be non-empty and without braces: {self.scope!r}")
        if self.dimension not in DIMENSIONS:
            raise ValueError(f"rate limit dimension must be one of {DIMENSIONS}, got {self.dimension!r}")
        if isinstance(self.per_minute, bool) or not isinstance(self.per_minute, int) or self.per_minute < 1:
            raise ValueError(f"rate limit per_minute must be a positive integer, got {self.per_minute!r}")

    def cost(self, requests: int, tokens: int) -> int:
        return requests if self.dimension == "requests" else tokens


@dataclass
class Decision:
    allowed: bool
    permanent: bool              # the cost exceeds a whole bucket: never retryable (x-should-retry: false)
    retry_after_s: float         # exact wait until all buckets can pay; 0 when allowed or permanent
    violated: Limit | None
    headers: dict[str, str]      # x-ratelimit-* per dimension (the most restrictive limit), and on a
                                 # retryable refusal Retry-After (ceil seconds) and retry-after-ms
    message: str                 # OpenAI-style explanation of a refusal; "" when allowed
    degraded: bool = False       # the backend was unreachable and fail-open let the request through
    unavailable: bool = False    # the backend was unreachable and fail-closed refused: answer 503, not 429


class RateLimiter(Protocol):
    async def acquire(self, limits: Sequence[Limit], requests: int, tokens: int) -> Decision:
        """All or nothing across `limits`: refill every bucket from the clock, check the cost against
        all, deduct from all or none."""
        ...

    async def reconcile(self, limits: Sequence[Limit], token_delta: int) -> None:
        """After the request, charge (+) or refund (-) `token_delta` on the tokens buckets among
        `limits`. A bucket may go negative (debt, which delays later requests) but never above capacity."""
        ...

    async def close(self) -> None:
        ...


@dataclass
class RateLimitConfig:
    backend: str = "memory"       # memory (one process) | redis (shared by every gateway replica)
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "llmserve:rl:"
    fail_mode: str = "open"       # open | closed: what to do when Redis is unreachable
    redis_timeout_s: float = 0.25  # budget for one limiter call to Redis, retry included

    def __post_init__(self) -> None:
        if self.backend not in ("memory", "redis"):
            raise ValueError(f"ratelimit.backend must be memory or redis, got {self.backend!r}")
        if self.fail_mode not in ("open", "closed"):
            raise ValueError(f"ratelimit.fail_mode must be open or closed, got {self.fail_mode!r}")
        if not self.redis_timeout_s > 0:
            raise ValueError(f"ratelimit.redis_timeout_s must be positive, got {self.redis_timeout_s!r}")


def validate_request(limits: Sequence[Limit], requests: int, tokens: int) -> None:
    """Bad calls fail loudly instead of corrupting shared buckets."""
    _require_int("requests", requests, minimum=0)
    _require_int("tokens", tokens, minimum=0)
    _require_distinct(limits)


def validate_reconcile(limits: Sequence[Limit], token_delta: int) -> None:
    _require_int("token_delta", token_delta)
    _require_distinct(limits)


def _require_int(name: str, value: object, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        kind = "a non-negative integer" if minimum == 0 else "an integer"
        raise ValueError(f"rate limit {name} must be {kind}, got {value!r}")


def _require_distinct(limits: Sequence[Limit]) -> None:
    buckets = [(limit.scope, limit.dimension) for limit in limits]
    if len(set(buckets)) != len(buckets):
        raise ValueError(f"the same bucket appears twice among the limits: {buckets}")

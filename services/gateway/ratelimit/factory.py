"""Builds the configured rate limiter."""

from __future__ import annotations

from .base import RateLimitConfig, RateLimiter
from .memory import MemoryRateLimiter
from .redis_backend import RedisRateLimiter


def make_rate_limiter(cfg: RateLimitConfig) -> RateLimiter:
    if cfg.backend == "redis":
        return RedisRateLimiter(cfg)
    return MemoryRateLimiter()

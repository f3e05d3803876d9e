"""Requests- and tokens-per-minute limits: token buckets, in process or shared in Redis."""

from .base import Decision, Limit, RateLimitConfig, RateLimiter
from .factory import make_rate_limiter

__all__ = ["Decision", "Limit", "RateLimitConfig", "RateLimiter", "make_rate_limiter"]

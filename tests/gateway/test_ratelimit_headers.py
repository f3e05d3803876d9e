"""Duration and header formats, and the configuration and limit values the limiter refuses."""

from __future__ import annotations

import pytest

from llmserve.config import load_config
from services.gateway.ratelimit import Limit, RateLimitConfig, make_rate_limiter
from services.gateway.ratelimit.headers import format_duration, retry_headers
from services.gateway.ratelimit.memory import MemoryRateLimiter
from services.gateway.ratelimit.redis_backend import RedisRateLimiter


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (0.0004, "1ms"), (0.012, "12ms"), (0.999, "999ms"), (1, "1s"), (8.64, "8.64s"),
    (12.000000000000002, "12s"), (59.9991, "1m0s"), (60, "1m0s"), (360, "6m0s"), (90.5, "1m30.5s"),
    (3725, "1h2m5s"), (-3, "0s"),
])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("wait_s, after, after_ms", [
    (12.0, "12", "12000"), (11.2, "12", "11200"), (0.0004, "1", "1"), (60 / 5 * 1.0000000000000002, "12", "12000"),
])
def test_retry_headers_round_up(wait_s, after, after_ms):
    assert retry_headers(wait_s) == {"Retry-After": after, "retry-after-ms": after_ms}


@pytest.mark.parametrize("kwargs, error", [
    ({"scope": "", "dimension": "requests", "per_minute": 5}, "scope"),
    ({"scope": "org:{7}", "dimension": "requests", "per_minute": 5}, "braces"),
    ({"scope": "org:7", "dimension": "images", "per_minute": 5}, "dimension"),
    ({"scope": "org:7", "dimension": "tokens", "per_minute": 0}, "positive integer"),
    ({"scope": "org:7", "dimension": "tokens", "per_minute": 2.5}, "positive integer"),
])
def test_bad_limits_are_rejected(kwargs, error):
    with pytest.raises(ValueError, match=error):
        Limit(**kwargs)


def test_config_is_validated_at_load(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("backend: redis\nfail_mode: closed\nredis_timeout_s: 1\n")
    cfg = load_config(RateLimitConfig, path)
    assert (cfg.backend, cfg.fail_mode, cfg.redis_timeout_s) == ("redis", "closed", 1.0)
    for bad, error in [("backend: dynamo\n", "backend must be memory or redis"),
                       ("fail_mode: maybe\n", "fail_mode must be open or closed"),
                       ("redis_timeout_s: 0\n", "redis_timeout_s must be positive")]:
        path.write_text(bad)
        with pytest.raises(ValueError, match=error):
            load_config(RateLimitConfig, path)


async def test_factory_builds_the_configured_backend():
    memory = make_rate_limiter(RateLimitConfig())
    shared = make_rate_limiter(RateLimitConfig(backend="redis"))
    assert isinstance(memory, MemoryRateLimiter) and isinstance(shared, RedisRateLimiter)
    await memory.close()
    await shared.close()

"""OpenAI's rate-limit headers and durations ("12ms", "8.64s", "6m0s")."""

from __future__ import annotations

import math


def ceil_ms(seconds: float) -> int:
    """Whole milliseconds, rounded up; float noise under a nanosecond does not add one."""
    return max(0, math.ceil(seconds * 1000 - 1e-6))


def format_duration(seconds: float) -> str:
    ms = ceil_ms(seconds)
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def bucket_headers(dimension: str, limit: int, remaining: int, reset_s: float) -> dict[str, str]:
    return {
        f"x-ratelimit-limit-{dimension}": str(limit),
        f"x-ratelimit-remaining-{dimension}": str(remaining),
        f"x-ratelimit-reset-{dimension}": format_duration(reset_s),
    }


def retry_headers(wait_s: float) -> dict[str, str]:
    ms = ceil_ms(wait_s)
    return {"Retry-After": str(-(-ms // 1000)), "retry-after-ms": str(ms)}


NO_RETRY = {"x-should-retry": "false"}

"""Prometheus counters shared by the rate limiter backends."""

from __future__ import annotations

from prometheus_client import Counter

from .base import Decision

DECISIONS = Counter(
    "llmserve_gateway_ratelimit_decisions", "Rate limiter decisions.",
    ["result", "dimension"])  # result: allowed|limited|too_large|degraded|unavailable; dimension of the violated limit or none
BACKEND_ERRORS = Counter(
    "llmserve_gateway_ratelimit_backend_errors", "Rate limiter backend failures, by the fail mode applied.",
    ["mode"])


def count_decision(decision: Decision) -> Decision:
    if decision.degraded:
        result = "degraded"
    elif decision.unavailable:
        result = "unavailable"
    elif decision.allowed:
        result = "allowed"
    else:
        result = "too_large" if decision.permanent else "limited"
    dimension = decision.violated.dimension if decision.violated else "none"
    DECISIONS.labels(result=result, dimension=dimension).inc()
    return decision

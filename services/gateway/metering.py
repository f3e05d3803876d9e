"""Settling a finished request: true up the rate limits with the real token count (a disconnected
stream pays for what it produced), write the usage record, count tokens."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from services.gateway.auth import Principal
from services.gateway.metrics import GatewayMetrics
from services.gateway.ratelimit import Limit, RateLimiter
from services.gateway.store import Store, UsageRecord
from services.gateway.store.base import now_ms

log = logging.getLogger(__name__)


@dataclass
class Reservation:
    """What admission charged; settle() corrects it once."""
    principal: Principal
    model: str
    limits: list[Limit]
    reserved_tokens: int
    started: float = field(default_factory=time.monotonic)


class Metering:
    def __init__(self, store: Store, limiter: RateLimiter, metrics: GatewayMetrics):
        self._store = store
        self._limiter = limiter
        self._metrics = metrics

    async def refund(self, r: Reservation) -> None:
        """The request never ran (shed after admission): give its tokens back."""
        await self._reconcile(r, -r.reserved_tokens)

    async def settle(self, r: Reservation, request_id: str, prompt_tokens: int, completion_tokens: int,
                     cached_tokens: int, status: str) -> None:
        await self._reconcile(r, prompt_tokens + completion_tokens - r.reserved_tokens)
        self._metrics.tokens.labels(model=r.model, kind="prompt").inc(prompt_tokens)
        self._metrics.tokens.labels(model=r.model, kind="completion").inc(completion_tokens)
        record = UsageRecord(
            request_id=request_id, organization_id=r.principal.organization.id, key_id=r.principal.key.id,
            model=r.model, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            cached_tokens=cached_tokens, latency_ms=int((time.monotonic() - r.started) * 1000), status=status,
            created_at_ms=now_ms())
        try:
            await self._store.record_usage(record)
        except Exception:
            log.exception("could not record usage of %s", request_id)

    async def _reconcile(self, r: Reservation, delta: int) -> None:
        if not r.limits or delta == 0:
            return
        try:
            await self._limiter.reconcile(r.limits, delta)
        except Exception:
            log.exception("could not reconcile rate limits (delta %d)", delta)

"""Load shedding: per model, at most N requests in flight and a short bounded queue behind them.

Past the queue, or after queue_timeout_s in it, a request is refused at once (429 or 503 with
Retry-After), so the admitted ones keep their latency while the excess goes elsewhere.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

from services.gateway.config import OverloadConfig
from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics


class Overloaded(ApiError):
    """The model's in-flight slots and queue are full; nothing was sent upstream."""


class _ModelGate:
    def __init__(self, max_in_flight: int):
        self.slots = asyncio.Semaphore(max_in_flight)
        self.in_flight = 0
        self.queued = 0


class OverloadGuard:
    def __init__(self, cfg: OverloadConfig, metrics: GatewayMetrics):
        self._cfg = cfg
        self._metrics = metrics
        self._gates: dict[str, _ModelGate] = {}

    def _refusal(self, model: str, why: str) -> Overloaded:
        self._metrics.overload_refusals.labels(model=model).inc()
        retry = self._cfg.retry_after_s
        return Overloaded(self._cfg.refuse_status, f"the model `{model}` is overloaded ({why}); retry shortly",
                        code="overloaded", type="rate_limit_error" if self._cfg.refuse_status == 429 else None,
                        headers={"Retry-After": str(max(1, round(retry))), "retry-after-ms": str(int(retry * 1000))})

    @asynccontextmanager
    async def admit(self, model: str) -> AsyncIterator[None]:
        gate = self._gates.get(model)
        if gate is None:
            gate = self._gates[model] = _ModelGate(self._cfg.max_in_flight_per_model)
        if gate.slots.locked():
            if gate.queued >= self._cfg.max_queued_per_model:
                raise self._refusal(model, "queue full")
            gate.queued += 1
            self._metrics.queued.labels(model=model).set(gate.queued)
            try:
                await asyncio.wait_for(gate.slots.acquire(), self._cfg.queue_timeout_s)
            except TimeoutError:
                raise self._refusal(model, "queue timeout") from None
            finally:
                gate.queued -= 1
                self._metrics.queued.labels(model=model).set(gate.queued)
        else:
            await gate.slots.acquire()
        gate.in_flight += 1
        self._metrics.in_flight.labels(model=model).set(gate.in_flight)
        try:
            yield
        finally:
            gate.in_flight -= 1
            self._metrics.in_flight.labels(model=model).set(gate.in_flight)
            gate.slots.release()

"""Load shedding: per model, at most `limit` requests in flight and a short bounded queue behind them.

Past the queue, or after queue_timeout_s in it, a request is refused at once (429 or 503 with
Retry-After), so the admitted ones keep their latency while the excess goes elsewhere.

The limit follows the pool: max_in_flight_per_worker x the model's routable workers, shared among
the gateway replicas (this one takes 1/replicas of it, rounded up), within
[min_in_flight_per_model, max_in_flight_per_model]; set_workers is fed by pool_watch.py. With
max_in_flight_per_worker 0 it is a fixed max_in_flight_per_model per replica.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import asynccontextmanager
from typing import AsyncIterator, Mapping

from services.gateway.config import OverloadConfig
from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics


class Overloaded(ApiError):
    """The model's in-flight slots and queue are full; nothing was sent upstream."""


class _ModelGate:
    """In-flight requests against a limit that may change; waiters get slots first come, first served.
    Invariant: in_flight counts granted slots, including one granted to a waiter not yet resumed."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0
        self.waiters: deque[asyncio.Future] = deque()

    def try_enter(self) -> bool:
        if self.waiters or self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    async def wait(self, timeout: float) -> None:
        """Waits for a slot; raises TimeoutError after `timeout` holding none."""
        slot = asyncio.get_running_loop().create_future()
        self.waiters.append(slot)
        try:
            await asyncio.wait_for(slot, timeout)
        except BaseException:
            if slot.done() and not slot.cancelled():
                self.leave()          # granted just as we gave up: hand it on
            raise
        finally:
            if slot in self.waiters:
                self.waiters.remove(slot)

    def leave(self) -> None:
        self.in_flight -= 1
        self.wake()

    def wake(self) -> None:
        while self.waiters and self.in_flight < self.limit:
            slot = self.waiters.popleft()
            if not slot.done():
                self.in_flight += 1
                slot.set_result(None)


class OverloadGuard:
    def __init__(self, cfg: OverloadConfig, metrics: GatewayMetrics):
        self._cfg = cfg
        self._metrics = metrics
        self._gates: dict[str, _ModelGate] = {}
        self._workers: Mapping[str, int] = {}
        self._default_workers = 0     # for a model the pool view does not list
        self._replicas = 1            # gateway replicas sharing the workers

    def limit(self, model: str) -> int:
        cfg = self._cfg
        if cfg.max_in_flight_per_worker <= 0:
            return cfg.max_in_flight_per_model
        workers = self._workers.get(model, self._default_workers)
        share = -(-cfg.max_in_flight_per_worker * workers // self._replicas)
        return min(max(share, cfg.min_in_flight_per_model), cfg.max_in_flight_per_model)

    def set_workers(self, workers: Mapping[str, int], default: int = 0, replicas: int = 1) -> None:
        """The routable workers of each model (`default` for the others) and the gateway replicas
        sharing them; limits follow at once."""
        self._workers, self._default_workers, self._replicas = dict(workers), default, max(1, replicas)
        for model in set(self._gates) | set(workers):
            self._gate(model)
        for model, gate in self._gates.items():
            gate.limit = self.limit(model)
            self._metrics.overload_limit.labels(model=model).set(gate.limit)
            gate.wake()

    def _gate(self, model: str) -> _ModelGate:
        gate = self._gates.get(model)
        if gate is None:
            gate = self._gates[model] = _ModelGate(self.limit(model))
            self._metrics.overload_limit.labels(model=model).set(gate.limit)
        return gate

    def _refusal(self, model: str, why: str) -> Overloaded:
        self._metrics.overload_refusals.labels(model=model).inc()
        retry = self._cfg.retry_after_s
        return Overloaded(self._cfg.refuse_status, f"the model `{model}` is overloaded ({why}); retry shortly",
                        code="overloaded", type="rate_limit_error" if self._cfg.refuse_status == 429 else None,
                        headers={"Retry-After": str(max(1, round(retry))), "retry-after-ms": str(int(retry * 1000))})

    @asynccontextmanager
    async def admit(self, model: str) -> AsyncIterator[None]:
        gate = self._gate(model)
        if not gate.try_enter():
            if len(gate.waiters) >= self._cfg.max_queued_per_model:
                raise self._refusal(model, "queue full")
            queued = self._metrics.queued.labels(model=model)
            queued.inc()
            try:
                await gate.wait(self._cfg.queue_timeout_s)
            except TimeoutError:
                raise self._refusal(model, "queue timeout") from None
            finally:
                queued.dec()
        in_flight = self._metrics.in_flight.labels(model=model)
        in_flight.set(gate.in_flight)
        try:
            yield
        finally:
            gate.leave()
            in_flight.set(gate.in_flight)

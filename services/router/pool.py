"""The router's view of its workers: one pool per model, each worker with its live state.

A worker stays listed while it is unhealthy (for the admin view) but takes no requests until its
health check passes again. Its prefix memory outlives that: a busy worker that misses a check, or a
call cut off, still holds its cache. The memory is forgotten when the worker is seen to have
restarted (its cumulative prefix-cache counter went backwards) or leaves the pool. A restart not
caught that way (other routers' traffic pushed the new counter past the old) costs cache misses
until the memory's LRU catches up, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Literal

import grpc

from llmserve.v1 import router_pb2, worker_pb2, worker_pb2_grpc

from .prefix_index import PrefixIndex

Source = Literal["static", "dns", "registered"]

CHANNEL_OPTIONS = [
    # Notice a dead worker quickly and reconnect soon after it comes back.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


@dataclass(eq=False)
class Worker:
    address: str
    model: str
    source: Source
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.GenerationStub
    healthy: bool = False                 # unknown until the first check passes
    draining: bool = False                # set through the admin API
    in_flight: int = 0                    # dispatched by this router, stream not yet ended
    load: worker_pb2.LoadReport = field(default_factory=worker_pb2.LoadReport)
    model_info: worker_pb2.ModelInfo | None = None

    @property
    def routable(self) -> bool:
        """Takes new requests: healthy and draining neither here nor on its own (shutting down)."""
        return self.healthy and not self.draining and not self.load.draining

    @property
    def load_score(self) -> int:
        """Requests on the worker. Our own count is exact at once; the worker's report is stale but
        also sees other routers' requests. Ours appear in both, so the larger is the better guess."""
        return max(self.in_flight, self.load.running + self.load.waiting)

    def status(self) -> router_pb2.WorkerStatus:
        return router_pb2.WorkerStatus(
            address=self.address, model=self.model, healthy=self.healthy, draining=self.draining,
            in_flight=self.in_flight, load=self.load, source=self.source)


class Pool:
    """One model's workers and the prefix memory the routing policy keeps about them."""

    def __init__(self, model: str, max_blocks_per_worker: int):
        self.model = model
        self.workers: dict[str, Worker] = {}
        self.prefixes = PrefixIndex(max_blocks_per_worker)
        self._turn = itertools.count()   # round-robin position, shared by every policy
        self._last_info: worker_pb2.ModelInfo | None = None

    def routable(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.routable]

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy]

    def next_turn(self) -> int:
        return next(self._turn)

    def model_info(self) -> worker_pb2.ModelInfo:
        """What the pool's healthy workers report about the model, kept while none is healthy (a
        busy worker missing a check does not change the model); just its name before any reported."""
        reported = next((w.model_info for w in self.healthy() if w.model_info), None)
        if reported is not None:
            self._last_info = reported
        return self._last_info or worker_pb2.ModelInfo(name=self.model)

    def set_healthy(self, worker: Worker, healthy: bool) -> None:
        if not healthy:
            worker.model_info = None   # it may come back as something else
        worker.healthy = healthy

    def observe_load(self, worker: Worker, report: worker_pb2.LoadReport) -> None:
        """Takes the worker's latest load report: a restart empties its prefix memory, and the
        memory never outgrows the worker's KV cache (the workers' blocks, as many as it reports)."""
        if report.prefix_cache_queries < worker.load.prefix_cache_queries:
            self.prefixes.drop(worker.address)
        self.prefixes.set_limit(worker.address, report.kv_blocks_total)
        worker.load = report


class WorkerRegistry:
    """All pools, keyed by model; every worker address appears in at most one pool."""

    def __init__(self, max_blocks_per_worker: int, close_grace_s: float):
        self.pools: dict[str, Pool] = {}
        self._max_blocks = max_blocks_per_worker
        self._close_grace_s = close_grace_s
        self._closing: set[asyncio.Task] = set()

    def pool(self, model: str, create: bool = False) -> Pool | None:
        if model not in self.pools and create:
            self.pools[model] = Pool(model, self._max_blocks)
        return self.pools.get(model)

    def workers(self, model: str = "") -> list[Worker]:
        """Every worker, or the given model's (none if there is no such pool)."""
        if not model:
            return [w for p in self.pools.values() for w in p.workers.values()]
        pool = self.pools.get(model)
        return list(pool.workers.values()) if pool else []

    def find(self, address: str) -> Worker | None:
        return next((w for w in self.workers() if w.address == address), None)

    def add(self, address: str, model: str, source: Source) -> Worker:
        """Adds a worker, or returns the one already known at that address (in the same pool)."""
        known = self.find(address)
        if known is not None:
            if known.model != model:
                raise ValueError(f"worker {address} already serves model {known.model!r}, not {model!r}")
            return known
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        worker = Worker(address=address, model=model, source=source, channel=channel,
                        stub=worker_pb2_grpc.GenerationStub(channel))
        self.pool(model, create=True).workers[address] = worker
        return worker

    def remove(self, address: str) -> Worker | None:
        """Takes the worker out of its pool; its running streams get a grace period to finish."""
        worker = self.find(address)
        if worker is None:
            return None
        pool = self.pools[worker.model]
        del pool.workers[address]
        pool.prefixes.drop(address)
        worker.healthy = False
        task = asyncio.create_task(worker.channel.close(grace=self._close_grace_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return worker

    async def close(self) -> None:
        for worker in self.workers():
            self.remove(worker.address)
        await asyncio.gather(*self._closing, return_exceptions=True)


def total_load(workers: list[Worker]) -> worker_pb2.LoadReport:
    """The sum of the workers' last load reports."""
    total = worker_pb2.LoadReport()
    for w in workers:
        for name in ("running", "waiting", "kv_blocks_used", "kv_blocks_total",
                     "prefix_cache_hits", "prefix_cache_queries", "num_preemptions"):
            setattr(total, name, getattr(total, name) + getattr(w.load, name))
    return total

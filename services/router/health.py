"""Periodic grpc.health.v1 checks and GetLoad polls of every known worker.

A worker is healthy when its health check says SERVING, it answers GetLoad, and its ListModels
names the model of the pool it sits in (a worker configured into the wrong pool never gets traffic).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.v1 import worker_pb2

from .config import HealthConfig
from .pool import Worker, WorkerRegistry

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, registry: WorkerRegistry, config: HealthConfig):
        self.registry = registry
        self.config = config

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.config.interval_s)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.registry.workers()))

    async def check(self, worker: Worker) -> None:
        try:
            load = await self._probe(worker)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
            load = None
            if worker.healthy:
                log.warning("worker %s failed its check: %s", worker.address, _describe(e))
        pool = self.registry.pool(worker.model)
        if pool is None or pool.workers.get(worker.address) is not worker:
            return   # removed while we asked
        healthy = load is not None
        if healthy:
            pool.observe_load(worker, load)
        if healthy != worker.healthy:
            log.info("worker %s (%s) is %s", worker.address, worker.model,
                     "healthy" if healthy else "unhealthy")
        pool.set_healthy(worker, healthy)

    async def _probe(self, worker: Worker) -> worker_pb2.LoadReport | None:
        """The worker's load report, or None when it is not fit to serve the pool's model."""
        timeout = self.config.timeout_s
        reply = await health_pb2_grpc.HealthStub(worker.channel).Check(
            health_pb2.HealthCheckRequest(service=self.config.service), timeout=timeout)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return None
        if worker.model_info is None:
            models = await worker.stub.ListModels(worker_pb2.ListModelsRequest(), timeout=timeout)
            info = next((m for m in models.models if m.name == worker.model), None)
            if info is None:
                log.error("worker %s serves %s, not %s: kept out of the pool", worker.address,
                          [m.name for m in models.models], worker.model)
                return None
            worker.model_info = info
        return await worker.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=timeout)


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return type(error).__name__

"""The router assembled: pools, discovery, health checks, policy and forwarder behind one gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmserve.v1 import router_pb2_grpc, worker_pb2_grpc

from .config import RouterConfig
from .discovery import Discovery
from .forwarder import Forwarder
from .health import HealthChecker
from .metrics import RouterMetrics
from .policy import make_policy
from .pool import WorkerRegistry
from .server import GenerationServicer, RouterServicer

log = logging.getLogger(__name__)

SERVICES = ("", "llmserve.v1.Generation", "llmserve.v1.Router")


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.metrics = RouterMetrics()
        self.registry = WorkerRegistry(config.policy.max_blocks_per_worker,
                                       close_grace_s=config.server.grace_period_s)
        self.discovery = Discovery(self.registry, config.models, config.discovery)
        self.health = HealthChecker(self.registry, config.health)
        self.forwarder = Forwarder(self.registry, make_policy(config.policy), config.forward,
                                   config.policy.block_chars, self.metrics)
        self.metrics.watch(self.registry.workers)
        self.own_health = health.aio.HealthServicer()
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.registry, self.forwarder), self.server)
        router_pb2_grpc.add_RouterServicer_to_server(
            RouterServicer(self.registry, self.discovery, self.health), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.own_health, self.server)
        self.port = 0
        self._loops: list[asyncio.Task] = []

    async def start(self) -> int:
        """Finds and checks the workers once, then serves; returns the bound port."""
        cfg = self.config.server
        self.discovery.add_static()
        await self.discovery.refresh_dns()
        await self.health.check_all()
        self.port = self.server.add_insecure_port(f"{cfg.host}:{cfg.port}")
        if not self.port:
            raise OSError(f"cannot listen on {cfg.host}:{cfg.port}")
        await self.server.start()
        for name in SERVICES:
            await self.own_health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.metrics.serve(cfg.host, cfg.metrics_port)
        self._loops = [asyncio.create_task(self.discovery.run()), asyncio.create_task(self.health.run())]
        log.info("router listening on %s:%d, pools: %s", cfg.host, self.port,
                 {m: len(p.workers) for m, p in self.registry.pools.items()})
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        """Stops taking requests, lets running streams finish for `grace` seconds, then cancels."""
        await self.own_health.enter_graceful_shutdown()
        await self.server.stop(grace)
        for task in self._loops:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.registry.close()
        self.metrics.close()

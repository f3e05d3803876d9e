"""Thin gRPC servicers: llmserve.v1.Generation (the workers' contract) and llmserve.v1.Router (admin)."""

from __future__ import annotations

import contextlib

import grpc

from llmserve.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from .discovery import Discovery
from .forwarder import Forwarder, RouteError
from .health import HealthChecker
from .pool import WorkerRegistry, total_load


class GenerationServicer(worker_pb2_grpc.GenerationServicer):
    def __init__(self, registry: WorkerRegistry, forwarder: Forwarder):
        self.registry = registry
        self.forwarder = forwarder

    async def Generate(self, request, context):
        stream = self.forwarder.generate(request, context.invocation_metadata() or (),
                                         context.time_remaining())
        try:
            # aclosing: a cancelled caller must close the worker call now, not at garbage collection.
            async with contextlib.aclosing(stream):
                async for response in stream:
                    await context.write(response)
        except RouteError as e:
            await context.abort(e.code, e.message)

    async def ListModels(self, request, context):
        return worker_pb2.ListModelsResponse(
            models=[pool.model_info() for pool in self.registry.pools.values()])

    async def Tokenize(self, request, context):
        try:
            return await self.forwarder.tokenize(request, context.invocation_metadata() or ())
        except RouteError as e:
            await context.abort(e.code, e.message)

    async def GetLoad(self, request, context):
        workers = [w for w in self.registry.workers() if w.healthy]
        report = total_load(workers)
        if len(self.registry.pools) == 1:
            report.model = next(iter(self.registry.pools))
        return report


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, registry: WorkerRegistry, discovery: Discovery, health: HealthChecker):
        self.registry = registry
        self.discovery = discovery
        self.health = health

    async def ListWorkers(self, request, context):
        if request.model and self.registry.pool(request.model) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no pool for model {request.model!r}")
        return router_pb2.ListWorkersResponse(
            workers=[w.status() for w in self.registry.workers(request.model)])

    async def SetDraining(self, request, context):
        worker = self.registry.find(request.address)
        if worker is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker at {request.address!r}")
        worker.draining = request.draining
        return worker.status()

    async def RegisterWorker(self, request, context):
        try:
            worker = self.discovery.register(request.address, request.model)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await self.health.check(worker)   # routable now if it serves, not one interval later
        return worker.status()

    async def DeregisterWorker(self, request, context):
        if self.registry.remove(request.address) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker at {request.address!r}")
        return router_pb2.DeregisterWorkerResponse()

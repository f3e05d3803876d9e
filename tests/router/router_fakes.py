"""Scripted fake workers on real grpc.aio servers, and a router in front of them.

The fakes serve the whole worker contract (Generation + grpc.health.v1) so the router's routing,
failover, draining and cancellation logic runs over real gRPC; the real worker is tested elsewhere.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmserve.v1 import router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.router.app import Router
from services.router.config import HealthConfig, PolicyConfig, PoolConfig, RouterConfig, ServerConfig

Hold = Literal["before_first", "after_first"] | None


class FakeWorker(worker_pb2_grpc.GenerationServicer):
    """Streams `tokens` messages per request. While `hold` is set, new requests stop before or
    after their first message until `release()`; `fail_with` makes Generate answer with an error."""

    def __init__(self, model: str = "m", tokens: int = 3):
        self.model = model
        self.tokens = tokens
        self.hold: Hold = None
        self.fail_with: grpc.StatusCode | None = None
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.first_sent = 0       # requests that have streamed their first message
        self.cancelled = 0        # requests whose call was cancelled by the router
        self.load = worker_pb2.LoadReport(model=model)
        self._gate = asyncio.Event()
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self, port: int = 0) -> FakeWorker:
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_GenerationServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{port}"
        await self.server.start()
        await self.set_serving(True)
        return self

    async def kill(self) -> None:
        """Stops the server at once: open streams are cut off, new connections refused."""
        await self.server.stop(None)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)

    def release(self) -> None:
        self._gate.set()

    async def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if self.fail_with is not None:
            await context.abort(self.fail_with, "scripted failure")
        hold = self.hold
        try:
            for i in range(self.tokens):
                if i == 0 and hold == "before_first" or i == 1 and hold == "after_first":
                    await self._gate.wait()
                last = i == self.tokens - 1
                yield worker_pb2.GenerateResponse(
                    request_id=request.request_id, text=f"t{i} ", token_ids=[i], worker=self.address,
                    finish_reason=worker_pb2.FINISH_REASON_STOP if last else worker_pb2.FINISH_REASON_UNSPECIFIED,
                    usage=worker_pb2.Usage(prompt_tokens=5, completion_tokens=self.tokens) if last else None)
                if i == 0:
                    self.first_sent += 1
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def ListModels(self, request, context):
        return worker_pb2.ListModelsResponse(models=[worker_pb2.ModelInfo(
            name=self.model, max_context_length=2048, dtype="float32", vocab_size=100, owned_by="test")])

    async def Tokenize(self, request, context):
        ids = [len(w) for w in request.text.split()]
        return worker_pb2.TokenizeResponse(token_ids=ids, count=len(ids), max_context_length=2048)

    async def GetLoad(self, request, context):
        return self.load


def router_config(pools: dict[str, list[FakeWorker]], policy: str = "cache_aware", **policy_kw) -> RouterConfig:
    return RouterConfig(
        server=ServerConfig(port=0, metrics_port=0, grace_period_s=0.5),
        models={model: PoolConfig(addresses=[w.address for w in workers]) for model, workers in pools.items()},
        health=HealthConfig(interval_s=0.05, timeout_s=1.0),
        policy=PolicyConfig(name=policy, **policy_kw))


class RouterClient:
    """A started router and stubs for both of its services."""

    def __init__(self, router: Router):
        self.router = router
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
        self.generation = worker_pb2_grpc.GenerationStub(self.channel)
        self.admin = router_pb2_grpc.RouterStub(self.channel)

    async def generate(self, model: str = "m", text: str = "hello", **kw) -> list[worker_pb2.GenerateResponse]:
        request = worker_pb2.GenerateRequest(model=model, text=text, **kw)
        return [r async for r in self.generation.Generate(request, timeout=10)]


async def eventually(condition, timeout: float = 5.0, what: str = "condition") -> None:
    """Waits for `condition()` to hold (state that changes in the background: checks, cancels)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def read_rest(call) -> list[worker_pb2.GenerateResponse]:
    """The remaining messages of a call already read with read() (the styles may not be mixed)."""
    rest = []
    while (message := await call.read()) is not grpc.aio.EOF:
        rest.append(message)
    return rest

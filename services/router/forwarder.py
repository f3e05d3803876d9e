"""Sends a request to a worker of its model's pool and streams the answer back, with failover.

Invariants:
- a request counts in its worker's in_flight from dispatch until its stream ends, fails or is
  cancelled, so a burst sees the load it is creating;
- a request is retried on another worker only while nothing has been streamed to the caller;
  once output went out, a failing worker ends the stream with UNAVAILABLE;
- error messages to the caller name no worker address (they reach API clients through the
  gateway); the addresses and the failure details go to the log;
- a worker that fails a call (unreachable, connection dropped) leaves the pool at once, until
  the health checker sees it serving again;
- the worker's own answers (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...) reach the caller unchanged;
- cancelling the caller cancels the worker call; every worker call has a deadline.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Sequence

import grpc

from llmserve.v1 import worker_pb2

from .config import ForwardConfig
from .metrics import RouterMetrics
from .policy import Policy
from .pool import Pool, Worker, WorkerRegistry
from .prefix_index import block_hashes, routing_key

log = logging.getLogger(__name__)

Metadata = Sequence[tuple[str, str]]

# Codes by which a worker (or the way to it) failed, rather than answered.
WORKER_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


class RouteError(Exception):
    """Ends a call with this gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class WorkerFailed(Exception):
    pass


class Forwarder:
    def __init__(self, registry: WorkerRegistry, policy: Policy, config: ForwardConfig,
                 block_chars: int, metrics: RouterMetrics):
        self.registry = registry
        self.policy = policy
        self.config = config
        self.block_chars = block_chars   # routing-key block size of the pools' prefix memory
        self.metrics = metrics

    def pool_for(self, model: str) -> Pool:
        models = sorted(self.registry.pools)
        if not model:
            if len(models) == 1:
                return self.registry.pools[models[0]]
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"model is required: this router serves {', '.join(models) or 'no models'}")
        pool = self.registry.pool(model)
        if pool is None:
            raise RouteError(grpc.StatusCode.NOT_FOUND,
                             f"model {model!r} is not served here; models: {', '.join(models)}")
        return pool

    def passthrough(self, metadata: Metadata) -> list[tuple[str, str]]:
        keep = set(self.config.passthrough_metadata)
        return [(k, v) for k, v in metadata if k in keep]

    async def generate(self, request: worker_pb2.GenerateRequest, metadata: Metadata,
                       time_remaining: float | None) -> AsyncIterator[worker_pb2.GenerateResponse]:
        pool = self.pool_for(request.model)
        _check_prompt(request)
        if not request.model:
            request = _with_model(request, pool.model)
        hashes = affinity_hashes(request, self.block_chars)
        metadata = self.passthrough(metadata)
        timeout = min(self.config.request_timeout_s, time_remaining or float("inf"))
        failed: list[str] = []
        for _ in range(self.config.max_attempts):
            candidates = [w for w in pool.routable() if w.address not in failed]
            if not candidates:
                break
            choice = self.policy.choose(pool, candidates, hashes)
            worker = choice.worker
            self._count_dispatch(pool, worker, choice.decision, choice.matched_blocks, len(hashes))
            streamed = False
            worker.in_flight += 1
            call = None
            try:
                await self._connect(worker)
                call = worker.stub.Generate(request, metadata=metadata, timeout=timeout)
                async for response in call:
                    streamed = True
                    yield response
                return
            except (grpc.aio.AioRpcError, WorkerFailed) as e:
                reason = self._failure(pool, worker, e)
                if streamed:
                    self.metrics.mid_stream_failures.labels(pool.model, worker.address).inc()
                    log.warning("%s: worker %s failed mid-stream: %s", request.request_id or "request",
                                worker.address, reason)
                    raise RouteError(grpc.StatusCode.UNAVAILABLE,
                                     "the worker serving this request failed mid-stream; retry the request") from e
                log.warning("retrying %s elsewhere: worker %s failed: %s",
                            request.request_id or "request", worker.address, reason)
                self.metrics.retries.labels(pool.model, worker.address).inc()
                failed.append(worker.address)
            finally:
                worker.in_flight -= 1
                if call is not None:
                    call.cancel()   # a no-op after the end; reaches the worker if our caller left
        raise _no_worker(pool, failed, request.request_id)

    async def tokenize(self, request: worker_pb2.TokenizeRequest,
                       metadata: Metadata) -> worker_pb2.TokenizeResponse:
        pool = self.pool_for(request.model)
        if not request.model:
            request = _with_model(request, pool.model)
        failed = []
        for worker in sorted(pool.healthy(), key=lambda w: w.in_flight):
            try:
                await self._connect(worker)
                return await worker.stub.Tokenize(request, metadata=self.passthrough(metadata),
                                                  timeout=self.config.unary_timeout_s)
            except (grpc.aio.AioRpcError, WorkerFailed) as e:
                self._failure(pool, worker, e)
                failed.append(worker.address)
        raise _no_worker(pool, failed)

    async def _connect(self, worker: Worker) -> None:
        try:
            await asyncio.wait_for(worker.channel.channel_ready(), self.config.connect_timeout_s)
        except asyncio.TimeoutError:
            raise WorkerFailed(f"not connected within {self.config.connect_timeout_s}s") from None

    def _failure(self, pool: Pool, worker: Worker, error: grpc.aio.AioRpcError | WorkerFailed) -> str:
        """Takes a failed worker out of the pool and describes the failure; re-raises the
        worker's own answers (they are the caller's business, not a reason to fail over)."""
        if isinstance(error, grpc.aio.AioRpcError):
            if error.code() not in WORKER_FAILURES:
                raise RouteError(error.code(), error.details() or error.code().name) from error
            reason = f"{error.code().name}: {error.details()}"
        else:
            reason = str(error)
        pool.set_healthy(worker, False)
        return reason

    def _count_dispatch(self, pool: Pool, worker: Worker, decision: str, matched: int, total: int) -> None:
        self.metrics.routed.labels(pool.model, worker.address, decision).inc()
        if decision == "cache_hit":
            self.metrics.affinity_hits.labels(pool.model, worker.address).inc()
        self.metrics.prefix_blocks.labels(pool.model, "matched").inc(matched)
        self.metrics.prefix_blocks.labels(pool.model, "total").inc(total)


def affinity_hashes(request: worker_pb2.GenerateRequest, block_chars: int) -> list[int]:
    """What prefix affinity keys on: the caller's affinity key when set (e.g. an OpenAI
    prompt_cache_key: requests sharing it share one block, so they land together), else the prompt."""
    if request.affinity_key:
        return [hash(("affinity", request.cache_salt, request.affinity_key))]
    return block_hashes(routing_key(request), request.cache_salt, block_chars)


def _check_prompt(request: worker_pb2.GenerateRequest) -> None:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise RouteError(grpc.StatusCode.INVALID_ARGUMENT, "prompt is required: chat, text or token_ids")
    if kind == "chat" and not request.chat.messages:
        raise RouteError(grpc.StatusCode.INVALID_ARGUMENT, "chat prompt has no messages")


def _with_model(request, model: str):
    copy = type(request)()
    copy.CopyFrom(request)
    copy.model = model
    return copy


def _no_worker(pool: Pool, failed: list[str], request_id: str = "") -> RouteError:
    if failed:
        log.warning("%s: no healthy worker for model %s; failed: %s", request_id or "request", pool.model,
                    ", ".join(failed))
    return RouteError(grpc.StatusCode.UNAVAILABLE, f"no healthy worker for model {pool.model}")

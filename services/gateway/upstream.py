"""gRPC client of llmserve.v1.Generation (the router, or one worker: same contract), and of
Router.ListWorkers when the upstream is a router. gRPC failures become OpenAI API errors here."""

from __future__ import annotations

import logging
import time

import grpc

from llmserve.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.gateway.config import UpstreamConfig
from services.gateway.errors import ApiError
from services.gateway.request_context import REQUEST_ID

log = logging.getLogger(__name__)
_MAX_MESSAGE = 64 << 20


def api_error_from_grpc(e: grpc.aio.AioRpcError, what: str = "model service") -> ApiError:
    """The client's error for a failed call. The service's own answers pass through; when the
    service or the way to it is unavailable the client gets a fixed message, since gRPC's details
    then name internal addresses ("failed to connect to all addresses; last error: UNKNOWN:
    ipv4:10.0.3.7:50051: ..."): those go to the log with the request id."""
    code, detail = e.code(), e.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        too_long = "context" in detail.lower() or "too long" in detail.lower()
        return ApiError(400, detail, code="context_length_exceeded" if too_long else "invalid_value",
                        param="messages" if too_long else None)
    if code == grpc.StatusCode.NOT_FOUND:
        return ApiError(404, detail or f"{what}: not found", code="model_not_found", param="model")
    log.warning("request %s: %s call failed: %s %s", REQUEST_ID.get(), what, code.name, detail)
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        return ApiError(503, f"the {what} is unavailable; retry shortly", code="upstream_unavailable",
                        headers={"Retry-After": "1"})
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, f"the {what} timed out", code="upstream_timeout")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return ApiError(501, f"the {what} does not implement this: {detail}", code="not_implemented",
                        type="server_error")
    return ApiError(502, f"the {what} failed: {code.name} {detail}", code="upstream_error", type="server_error")


class Upstream:
    def __init__(self, cfg: UpstreamConfig):
        self._cfg = cfg
        self._channel = grpc.aio.insecure_channel(cfg.address, options=[
            ("grpc.max_receive_message_length", _MAX_MESSAGE), ("grpc.max_send_message_length", _MAX_MESSAGE)])
        self._generation = worker_pb2_grpc.GenerationStub(self._channel)
        self._router = router_pb2_grpc.RouterStub(self._channel)
        self._models: tuple[float, dict[str, worker_pb2.ModelInfo]] | None = None

    async def close(self) -> None:
        await self._channel.close()

    def generate(self, request: worker_pb2.GenerateRequest, metadata: list[tuple[str, str]]):
        """The streaming call; cancel() it to abort the request upstream."""
        return self._generation.Generate(request, metadata=metadata, timeout=self._cfg.request_timeout_s)

    async def models(self) -> dict[str, worker_pb2.ModelInfo]:
        now = time.monotonic()
        if self._models and self._models[0] > now:
            return self._models[1]
        try:
            reply = await self._generation.ListModels(worker_pb2.ListModelsRequest(),
                                                      timeout=self._cfg.unary_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise api_error_from_grpc(e, "model service") from None
        models = {m.name: m for m in reply.models}
        # A model none of whose workers has reported yet (context 0) is asked about again next time.
        if all(m.max_context_length for m in models.values()):
            self._models = (now + self._cfg.models_cache_ttl_s, models)
        return models

    async def model(self, name: str) -> worker_pb2.ModelInfo:
        """The model's description (max_context_length 0 while no worker of it has reported)."""
        info = (await self.models()).get(name)
        if info is None:
            raise ApiError(404, f"the model `{name}` does not exist", param="model", code="model_not_found")
        return info

    async def count_chat_tokens(self, model: str, messages: list[worker_pb2.ChatMessage],
                                metadata: list[tuple[str, str]]) -> int:
        try:
            reply = await self._generation.Tokenize(
                worker_pb2.TokenizeRequest(model=model, chat=worker_pb2.ChatPrompt(messages=messages)),
                timeout=self._cfg.unary_timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            raise api_error_from_grpc(e, "tokenizer") from None
        return reply.count

    async def list_workers(self, model: str = "") -> list[router_pb2.WorkerStatus]:
        try:
            reply = await self._router.ListWorkers(router_pb2.ListWorkersRequest(model=model),
                                                   timeout=self._cfg.unary_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise api_error_from_grpc(e, "router") from None
        return list(reply.workers)

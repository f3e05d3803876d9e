"""A scripted llmserve.v1.Generation (+ Router.ListWorkers) servicer for the gateway's own tests.

The reply is chosen by markers in the last message, so each test states its scenario in the prompt:
  default           "Hello there friend" as three messages of one token each, finish stop
  [words:N]         N tokens "w0 w1 ...", one message each (max_tokens still applies: finish length)
  [hang]            no token ever: waits until cancelled
  [drip]            one token every 20 ms until cancelled (or max_tokens)
  [fail-mid]        two tokens, then the call fails with INTERNAL
  [too-long]        INVALID_ARGUMENT before any token ("prompt is too long for the context")
  [say:TEXT]        TEXT split into one-character messages (to split safety matches)
  [slow]            20 ms between messages
  [refuse-constraint] INVALID_ARGUMENT naming the constraint's schema keyword, as a grammar engine refuses it
  [reply-system]    the first (system) message's text, in 3-character messages (scripted model output)
Every call is recorded; cancellations are recorded with the time they were seen.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import dataclass, field

import grpc

from llmserve.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

MODELS = {"fake-model": 2048, "tiny-model": 64}


def count_tokens(messages) -> int:
    return sum(len(m.content.split()) + 3 for m in messages)


@dataclass
class CallRecord:
    request: worker_pb2.GenerateRequest
    metadata: dict[str, str]
    started: float = field(default_factory=time.monotonic)
    tokens_sent: int = 0
    cancelled_at: float | None = None
    finished: threading.Event = field(default_factory=threading.Event)


class FakeGeneration(worker_pb2_grpc.GenerationServicer, router_pb2_grpc.RouterServicer):
    def __init__(self) -> None:
        self.calls: list[CallRecord] = []
        self.tokenize_calls = 0
        self.models = dict(MODELS)   # name -> context length; 0: no worker has reported yet

    def find(self, marker: str) -> list[CallRecord]:
        return [c for c in self.calls if marker in (c.request.chat.messages[-1].content if c.request.chat.messages
                                                   else c.request.text)]

    async def ListModels(self, request, context):
        return worker_pb2.ListModelsResponse(models=[
            worker_pb2.ModelInfo(name=name, max_context_length=ctx, dtype="float32", owned_by="llmserve-test",
                                 vocab_size=49152, tool_call_format="hermes")
            for name, ctx in self.models.items()])

    async def Tokenize(self, request, context):
        self.tokenize_calls += 1
        count = count_tokens(request.chat.messages)
        return worker_pb2.TokenizeResponse(count=count, max_context_length=MODELS.get(request.model, 0))

    async def ListWorkers(self, request, context):
        return router_pb2.ListWorkersResponse(workers=[router_pb2.WorkerStatus(
            address="127.0.0.1:1", model="fake-model", healthy=True, in_flight=0, source="static")])

    async def Generate(self, request, context):
        record = CallRecord(request, dict(context.invocation_metadata()))
        self.calls.append(record)
        prompt = request.chat.messages[-1].content if request.WhichOneof("prompt") == "chat" else request.text
        sampling = request.sampling
        n = sampling.n or 1
        max_tokens = sampling.max_tokens or 10_000
        prompt_tokens = count_tokens(request.chat.messages)
        try:
            if "[too-long]" in prompt:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is too long for the context")
            if "[refuse-constraint]" in prompt:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "json_schema: unsupported keyword 'dependentSchemas'")
            if "[hang]" in prompt:
                await asyncio.sleep(3600)
            delay = 0.02 if "[drip]" in prompt or "[slow]" in prompt else 0.0
            if m := re.search(r"\[words:(\d+)\]", prompt):
                pieces = [f"w{i} " for i in range(int(m.group(1)))]
            elif "[reply-system]" in prompt:
                script = request.chat.messages[0].content
                pieces = [script[i:i + 3] for i in range(0, len(script), 3)]
            elif m := re.search(r"\[say:([^\]]*)\]", prompt):
                pieces = list(m.group(1))
            elif "[drip]" in prompt:
                pieces = [f"d{i} " for i in range(100_000)]
            else:
                pieces = ["Hello", " there", " friend"]
            produced = 0
            for step, piece in enumerate(pieces):
                if "[fail-mid]" in prompt and step == 2:
                    await context.abort(grpc.StatusCode.INTERNAL, "worker crashed")
                last = step == len(pieces) - 1 or step + 1 >= max_tokens
                reason = worker_pb2.FINISH_REASON_UNSPECIFIED
                if last:
                    reason = worker_pb2.FINISH_REASON_LENGTH if step + 1 >= max_tokens and step < len(pieces) - 1 \
                        else worker_pb2.FINISH_REASON_STOP
                for index in range(n):
                    reply = worker_pb2.GenerateResponse(request_id=request.request_id, index=index,
                                                        token_ids=[100 + step], text=piece, finish_reason=reason,
                                                        worker="fake")
                    if sampling.logprobs:
                        reply.logprobs.append(worker_pb2.TokenLogprob(
                            token_id=100 + step, token=piece, logprob=-0.5, bytes=piece.encode(),
                            top_logprobs=[worker_pb2.TopLogprob(token_id=7, token="x", logprob=-1.5, bytes=b"x")
                                          for _ in range(sampling.top_logprobs)]))
                    produced += 1
                    if last and index == n - 1:
                        reply.usage.CopyFrom(worker_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=produced,
                                                              cached_prompt_tokens=2))
                    record.tokens_sent = produced
                    yield reply
                if last:
                    break
                if delay:
                    await asyncio.sleep(delay)
        except (asyncio.CancelledError, GeneratorExit):
            record.cancelled_at = time.monotonic()
            raise
        finally:
            record.finished.set()


async def start_fake_upstream() -> tuple[grpc.aio.Server, FakeGeneration, str]:
    fake = FakeGeneration()
    server = grpc.aio.server()
    worker_pb2_grpc.add_GenerationServicer_to_server(fake, server)
    router_pb2_grpc.add_RouterServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, fake, f"127.0.0.1:{port}"

"""The worker's gRPC face: a thin mapping of llmserve.v1.Generation onto the async engine."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from llmserve.v1 import worker_pb2 as pb
from llmserve.v1 import worker_pb2_grpc
from services.worker.engine.core_protocol import EngineDead
from services.worker.engine.fair_queue import FairShare
from services.worker.engine.output_processor import RequestOutput
from services.worker.engine.sampling_params import Constraint, SamplingParams
from services.worker.metrics import WorkerMetrics
from services.worker.model.chat_template import parse_tools
from services.worker.model.tokenizer import Tokenizer

CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}
FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
MAX_PROMPT_CHARS = 4 * 1024 * 1024
TOKENIZER_THREADS = 2   # bounded: a flood of huge prompts cannot take every core from the engine


@dataclass
class ServedModel:
    name: str
    max_context_length: int
    dtype: str
    vocab_size: int
    tool_call_format: str = "hermes"


class BadRequest(ValueError):
    pass


def constraint_from_proto(c: pb.Constraint) -> Constraint | None:
    """The request's constraint (None when unset); its grammar is checked when the engine compiles it."""
    kind = c.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not c.json_object):
        return None
    if kind == "choice":
        if not c.choice.choices:
            raise BadRequest("constraint.choice needs at least one choice")
        return Constraint("choice", json.dumps(list(c.choice.choices)))
    if kind == "json_object":
        return Constraint("json_object")
    value = getattr(c, kind)
    if not value:
        raise BadRequest(f"constraint.{kind} is empty")
    return Constraint(kind, value, strict=c.strict)


def params_from_proto(request: pb.GenerateRequest) -> SamplingParams:
    params = sampling_from_proto(request.sampling)
    params.constraint = constraint_from_proto(request.constraint)
    return params


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k, min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        max_tokens=s.max_tokens or None, min_tokens=s.min_tokens,
        stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        logprobs=s.logprobs, top_logprobs=s.top_logprobs, n=s.n or 1,
        num_speculative_tokens=s.num_speculative_tokens if s.HasField("num_speculative_tokens") else None,
        logit_bias=dict(s.logit_bias))


def prompt_token_ids(tokenizer: Tokenizer, request) -> list[int]:
    """The prompt of a GenerateRequest or TokenizeRequest as token ids (chat rendered first).
    Slow for a long prompt (about 1 s a MB): call it off the event loop."""
    kind = request.WhichOneof("prompt")
    if kind == "chat":
        messages = request.chat.messages
        if not messages:
            raise BadRequest("chat prompt has no messages")
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise BadRequest(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {m.role!r}")
        if sum(len(m.content) for m in messages) + len(request.chat.tools_json) > MAX_PROMPT_CHARS:
            raise BadRequest(f"the prompt is longer than {MAX_PROMPT_CHARS} characters")
        tools = parse_tools(request.chat.tools_json)
        text = tokenizer.apply_chat_template([chat_message(m) for m in messages], tools=tools)
        return tokenizer.encode(text)
    if kind == "text":
        if len(request.text) > MAX_PROMPT_CHARS:
            raise BadRequest(f"the prompt is longer than {MAX_PROMPT_CHARS} characters")
        return tokenizer.encode(request.text)
    if kind == "token_ids":
        return list(request.token_ids.ids)
    raise BadRequest("the request has no prompt (chat, text or token_ids)")


def chat_message(m: pb.ChatMessage) -> dict:
    """A chat message in the OpenAI shape the chat template takes."""
    message = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.name:
        message["name"] = m.name
    return message


class GenerationServicer(worker_pb2_grpc.GenerationServicer):
    def __init__(self, engine, tokenizer: Tokenizer, model: ServedModel, worker_name: str,
                 metrics: WorkerMetrics | None = None) -> None:
        # The engine client: AsyncEngine (in process) or EngineCoreClient (core in its own process).
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model
        self.worker_name = worker_name
        self.metrics = metrics
        self.draining = False
        # Tokenizing and rendering the chat template run here, never on the event loop that
        # carries every stream of this worker.
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    async def _prompt_ids(self, request, fit_context: bool) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, self._tokenize, request, fit_context)

    def _tokenize(self, request, fit_context: bool) -> list[int]:
        """In a tokenizer thread. fit_context refuses a prompt longer than the context here, so the
        engine's own per-token check (on the event loop) only ever sees prompts that fit."""
        ids = prompt_token_ids(self.tokenizer, request)
        if fit_context and len(ids) >= self.model.max_context_length:
            raise BadRequest(f"the prompt has {len(ids)} tokens; this model's context length is "
                             f"{self.model.max_context_length}")
        return ids

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        await self._check_model(request.model, context)
        try:
            ids = await self._prompt_ids(request, fit_context=True)
            params = params_from_proto(request)
            if params.constraint is not None:   # compiled off the event loop; the engine finds it cached
                await asyncio.get_running_loop().run_in_executor(
                    self._tokenizer_pool, self.engine.compile_grammar, params.constraint)
            share = FairShare.of(request.tenant, request.tenant_weight, request.priority)
            stream = self.engine.generate(ids, params, request.request_id, request.cache_salt, share)
            first = await anext(stream)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDead as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        start = time.monotonic()
        last, completion, done = start, {}, 0
        output: RequestOutput | None = first
        try:
            while output is not None:
                now = time.monotonic()
                self._observe_latency(output, completion, start, last, now)
                last = now
                completion[output.index] = output.num_output_tokens
                message = self._response(request.request_id, output)
                if output.finished:
                    done += 1
                    if done == params.n:
                        message.usage.CopyFrom(pb.Usage(
                            prompt_tokens=output.num_prompt_tokens, completion_tokens=sum(completion.values()),
                            cached_prompt_tokens=output.num_cached_tokens,
                            spec_proposed_tokens=output.spec_proposed, spec_accepted_tokens=output.spec_accepted))
                        if self.metrics:
                            self.metrics.e2e.observe(now - start + output.queue_time_s)
                yield message
                output = await anext(stream, None)
        except EngineDead as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            await stream.aclose()   # aborts the request in the engine if it is still running

    def _observe_latency(self, output: RequestOutput, seen: dict, start: float, last: float, now: float) -> None:
        if self.metrics is None:
            return
        if not seen:
            self.metrics.queue.observe(output.queue_time_s)
            self.metrics.ttft.observe(now - start + output.queue_time_s)
        elif output.token_ids:
            self.metrics.itl.observe(now - last)
        if output.finished:
            self.metrics.spec_proposed += output.spec_proposed
            self.metrics.spec_accepted += output.spec_accepted

    def _response(self, request_id: str, output: RequestOutput) -> pb.GenerateResponse:
        message = pb.GenerateResponse(request_id=request_id or output.request_id, index=output.index,
                                      token_ids=output.token_ids, text=output.text,
                                      finish_reason=FINISH.get(output.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
                                      worker=self.worker_name)
        for lp in output.logprobs or ():
            message.logprobs.append(pb.TokenLogprob(
                token_id=lp.token_id, token=self.tokenizer.token_text(lp.token_id), logprob=lp.logprob,
                bytes=self.tokenizer.token_bytes(lp.token_id),
                top_logprobs=[pb.TopLogprob(token_id=t, token=self.tokenizer.token_text(t), logprob=v,
                                            bytes=self.tokenizer.token_bytes(t)) for t, v in lp.top]))
        return message

    async def ListModels(self, request, context):
        m = self.model
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            name=m.name, max_context_length=m.max_context_length, dtype=m.dtype, vocab_size=m.vocab_size,
            owned_by="llmserve", tool_call_format=m.tool_call_format)])

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        await self._check_model(request.model, context)
        try:
            ids = await self._prompt_ids(request, fit_context=False)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids, count=len(ids), max_context_length=self.model.max_context_length)

    async def GetLoad(self, request, context):
        s, limits = self.engine.stats, self.engine.limits
        return pb.LoadReport(model=self.model.name, running=s.running, waiting=s.waiting,
                             kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total,
                             prefix_cache_hits=s.prefix_cache_hits, prefix_cache_queries=s.prefix_cache_queries,
                             draining=self.draining, num_preemptions=s.num_preemptions,
                             waiting_prompt_tokens=s.load.waiting_prompt_tokens, step_time_s=s.load.step_time_s,
                             decode_tokens_per_s=s.load.decode_tokens_per_s,
                             prefill_tokens_per_s=s.load.prefill_tokens_per_s, max_num_seqs=limits.max_num_seqs,
                             max_num_batched_tokens=limits.max_num_batched_tokens, block_size=limits.block_size,
                             decode_step_base_s=s.load.decode_step_base_s,
                             decode_step_per_seq_s=s.load.decode_step_per_seq_s,
                             prefill_time_share=s.load.prefill_time_share)

    async def _check_model(self, name: str, context: grpc.aio.ServicerContext) -> None:
        if name and name != self.model.name:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model {name!r} is not served here (this worker serves {self.model.name!r})")

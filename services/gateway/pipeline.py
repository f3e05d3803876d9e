"""One request pipeline for every generating endpoint (chat completions, completions, responses).

Endpoints differ in their wire formats, not in what happens to a request. A route authenticates
(`Pipeline.open`), parses its body into a `Generation` (what to generate, in platform terms) and a
`Wire` (how its output is written), and `Pipeline.run` carries the request through the steps:

    model -> span -> conversation history -> input safety -> rate limits (reserve)
          -> admission -> upstream -> reply (whole or streamed) -> keep (store) -> settle

Whatever way the request ends, its bookkeeping (rate-limit reconcile, usage record, the keep step)
runs in a task of its own, so a client that went away still pays for what was produced and its
partial reply is kept.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import grpc
from aiohttp import web
from opentelemetry import trace

from llmserve.v1 import worker_pb2
from services.gateway.app import GATEWAY, Gateway
from services.gateway.auth import Principal
from services.gateway.completion import Completion, Delta
from services.gateway.conversation_resume import fit_history
from services.gateway.errors import ApiError, sse_error_event
from services.gateway.limits import admit, estimate_prompt_tokens, limits_for, reservation
from services.gateway.metering import Reservation
from services.gateway.overload import Overloaded, Ticket
from services.gateway.sse import KEEPALIVE, EventStream, with_keepalive
from services.gateway.tracing import grpc_metadata, set_request_attributes, set_response_attributes
from services.gateway.upstream import api_error_from_grpc

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """What an endpoint asks for, validated at its edge. Exactly one prompt kind is set."""
    model: str
    sampling: worker_pb2.SamplingParams
    chat: list[worker_pb2.ChatMessage] | None = None   # rendered by the model's chat template
    text: str | None = None                            # raw text prompt
    token_ids: list[int] | None = None
    tools_json: str = ""                                # chat only: JSON array of function tools
    constraint: worker_pb2.Constraint | None = None
    constraint_param: str = "response_format"           # named by a refusal of the constraint upstream
    stream: bool = False
    max_tokens: int | None = None
    logprobs: bool = False
    moderated: list[str] = field(default_factory=list)  # the texts the input safety check reads
    history_conversation: str | None = None             # stored conversation whose history goes first
    affinity_key: str = ""                              # routing affinity (prompt_cache_key)
    temperature: float | None = None
    id_prefix: str = "chatcmpl-"
    id: str = ""                                        # the reply's id when the endpoint chose it
    operation: str = "chat"                             # gen_ai.operation.name and the span's name

    @property
    def n(self) -> int:
        return self.sampling.n or 1

    def prompt_texts(self) -> list[str]:
        if self.chat is not None:
            texts = [m.content + "".join(c.name + c.arguments for c in m.tool_calls) for m in self.chat]
            return texts + [self.tools_json] if self.tools_json else texts
        if self.text is not None:
            return [self.text]
        return []


class Wire(Protocol):
    """An endpoint's output format over the shared Completion (which holds choices and usage)."""
    done: bytes   # written at the very end of a stream (`data: [DONE]`), or b""

    def opening(self) -> list[bytes]:
        """Events before the first delta (e.g. the role chunk)."""

    def delta(self, delta: Delta) -> list[bytes]:
        """Events for one choice's new text / finish."""

    def closing(self) -> list[bytes]:
        """Events after every choice finished (usage, completed)."""

    def body(self) -> dict[str, Any]:
        """The whole (non-streamed) response."""


class Keeper(Protocol):
    """What is stored when the request ends (a conversation turn, a stored response): once,
    before the reply's end goes out (read-your-writes), again from bookkeeping if it never ran."""

    async def keep(self, gw: Gateway, principal: Principal, completion: Completion, partial: bool) -> None:
        """Raises ApiError when the store failed for good (the client is told, if still there)."""


@dataclass
class Outcome:
    """How the request ended, filled in as it runs."""
    status: str = "error"          # ok | content_filter | cancelled | error
    first_token_at: float | None = None
    last_token_at: float | None = None
    kept: bool = False             # the keeper ran
    started: float = field(default_factory=time.monotonic)


class Pipeline:
    """Carries one request through the steps. One object per HTTP request."""

    def __init__(self, request: web.Request, principal: Principal):
        self.request = request
        self.gw: Gateway = request.app[GATEWAY]
        self.principal = principal
        self.outcome = Outcome()
        self.keeper: Keeper | None = None
        self.admission: Ticket | None = None   # the admitted slot: its estimates meet what happened
        self.metadata: list[tuple[str, str]] = []
        self.context = 0
        self.info: worker_pb2.ModelInfo | None = None
        self.completion: Completion | None = None    # once the request went upstream

    @classmethod
    async def open(cls, request: web.Request) -> "Pipeline":
        """Authenticates the caller (before the body is read)."""
        gw = request.app[GATEWAY]
        return cls(request, await gw.auth.principal(request))

    @property
    def org_id(self) -> str:
        return self.principal.organization.id

    async def model(self, name: str, max_tokens: int | None, param: str = "max_completion_tokens"
                    ) -> worker_pb2.ModelInfo:
        """The model's description; refuses a model with no worker yet and max tokens past its context."""
        info = await self.gw.upstream.model(name)
        if not info.max_context_length:   # the router knows the model, but none of its workers has reported
            raise ApiError(503, f"the model `{name}` has no worker ready yet; retry shortly",
                           code="upstream_unavailable", headers={"Retry-After": "1"})
        if max_tokens and max_tokens > info.max_context_length:
            raise ApiError(400, f"{param} {max_tokens} exceeds the context of {name} "
                           f"({info.max_context_length} tokens)", param=param, code="invalid_value")
        self.info, self.context = info, info.max_context_length
        return info

    async def run(self, gen: Generation, wire_for: Callable[[Completion], Wire]) -> web.StreamResponse:
        """`wire_for(completion)` builds the endpoint's Wire once the completion exists."""
        if self.info is None or self.info.name != gen.model:
            await self.model(gen.model, gen.max_tokens)
        span = self.gw.tracer.start_span(f"{gen.operation} {gen.model}", kind=trace.SpanKind.CLIENT)
        try:
            set_request_attributes(span, gen.model, gen.max_tokens, gen.history_conversation, gen.temperature)
            span.set_attribute("gen_ai.operation.name", gen.operation)
            self.metadata = grpc_metadata(span, self.request["request_id"])
            return await self._admitted(gen, wire_for, span)
        except ApiError as e:
            span.set_attribute("error.type", e.code or str(e.status))
            raise
        finally:
            span.end()

    # -- steps ------------------------------------------------------------------------------------

    async def _history(self, gen: Generation) -> None:
        if not gen.history_conversation or gen.chat is None:
            return
        stored = await self.gw.conversations.get_chat(self.org_id, gen.history_conversation)
        reply_room = gen.max_tokens or self.gw.config.conversations.min_reply_tokens
        gen.chat = await fit_history(self.gw.upstream, gen.model, self.context, list(stored.messages), gen.chat,
                                     reply_room, self.metadata)

    async def _input_safety(self, gen: Generation, span: trace.Span) -> None:
        moderation = await self.gw.safety.check_input(self.org_id, gen.moderated)
        if moderation.blocked:
            raise ApiError(400, "the input was rejected by the safety policy",
                           param="messages" if gen.chat is not None else "prompt", code="content_policy_violation")
        if moderation.flagged:
            flagged = sorted(category for category, hit in moderation.categories.items() if hit)
            span.set_attribute("llmserve.safety.input_flagged", flagged)
            log.info("request %s: input flagged by rule %s", self.request["request_id"], moderation.matched_rule)

    async def _admitted(self, gen: Generation, wire_for: Callable[[Completion], Wire], span: trace.Span) -> web.StreamResponse:
        await self._history(gen)
        await self._input_safety(gen, span)
        prompt_estimate = len(gen.token_ids) if gen.token_ids is not None else \
            estimate_prompt_tokens(gen.prompt_texts(), self.context)
        limits = limits_for(self.principal)
        reserved = reservation(prompt_estimate, gen.n, gen.max_tokens, self.context)
        decision = await admit(self.gw.limiter, limits, reserved)
        self.request["ratelimit_headers"] = decision.headers
        ticket = Reservation(self.principal, gen.model, limits, reserved)
        try:
            async with self.gw.overload.admit(gen.model, org=self.org_id, weight=self.principal.organization.weight,
                                              priority=self.principal.key.priority, prompt_tokens=prompt_estimate,
                                              max_tokens=gen.max_tokens) as self.admission:
                return await self._run(gen, wire_for, prompt_estimate, ticket, span)
        except Overloaded:
            self.gw.spawn(self.gw.metering.refund(ticket))
            raise

    def _upstream_request(self, gen: Generation, request_id: str) -> worker_pb2.GenerateRequest:
        req = worker_pb2.GenerateRequest(request_id=request_id, model=gen.model, sampling=gen.sampling,
                                         cache_salt=self.org_id, affinity_key=gen.affinity_key, tenant=self.org_id,
                                         tenant_weight=self.principal.organization.weight,
                                         priority=self.principal.key.priority)
        if gen.chat is not None:
            req.chat.CopyFrom(worker_pb2.ChatPrompt(messages=gen.chat, tools_json=gen.tools_json))
        elif gen.text is not None:
            req.text = gen.text
        else:
            req.token_ids.ids.extend(gen.token_ids or [])
        if gen.constraint is not None:
            req.constraint.CopyFrom(gen.constraint)
        return req

    async def _run(self, gen: Generation, wire_for: Callable[[Completion], Wire], prompt_estimate: int, ticket: Reservation,
                   span: trace.Span) -> web.StreamResponse:
        guards = [self.gw.safety.output_guard(self.org_id) for _ in range(gen.n)]
        completion = Completion(gen.model, gen.n, guards, gen.logprobs, prompt_estimate, gen.id_prefix, gen.id)
        self.completion = completion
        wire = wire_for(completion)
        call = self.gw.upstream.generate(self._upstream_request(gen, completion.id), self.metadata)
        try:
            if gen.stream:
                return await self._stream(gen, wire, completion, call)
            await self._consume(gen, completion, call)
            body = wire.body()
            await self._keep(completion)  # before the reply: read-your-writes
            return web.json_response(body)
        except (asyncio.CancelledError, ConnectionResetError):
            self.outcome.status = "cancelled"
            raise
        finally:
            call.cancel()  # no-op once the stream ended; otherwise aborts the request upstream at once
            set_response_attributes(span, gen.model, completion.finish_reasons, completion.prompt_tokens,
                                    completion.completion_tokens, completion.id)
            self.gw.spawn(self._settle(gen, completion, ticket))

    async def _messages(self, gen: Generation, call, completion: Completion):
        """Upstream messages until every choice is done (a content filter stops reading early)."""
        try:
            async for msg in call:
                yield msg
                if completion.finished and "content_filter" in completion.finish_reasons:
                    return
        except grpc.aio.AioRpcError as e:
            error = api_error_from_grpc(e)
            if error.status == 400 and error.param is None and gen.constraint is not None:
                error.param = gen.constraint_param   # the worker refused the schema / grammar
            raise error from None

    def _tick(self, model: str) -> None:
        now, outcome = time.monotonic(), self.outcome
        series = self.gw.metrics.model(model)
        if outcome.first_token_at is None:
            outcome.first_token_at = now
            series.ttft.observe(now - outcome.started)
            if self.admission is not None:
                self.admission.first_token()
        else:
            series.inter_token.observe(now - outcome.last_token_at)
        if self.admission is not None:
            self.admission.progress(max(c.tokens for c in self.completion.choices))   # the budget is per choice
        outcome.last_token_at = now

    @property
    def produced(self) -> bool:
        """Output was generated (the keeper will run, or has)."""
        return self.completion is not None and self.completion.completion_tokens > 0

    def _finish(self, completion: Completion) -> None:
        self.outcome.status = "content_filter" if "content_filter" in completion.finish_reasons else "ok"

    async def _consume(self, gen: Generation, completion: Completion, call) -> None:
        async for msg in self._messages(gen, call, completion):
            if completion.accept(msg):
                self._tick(gen.model)
        completion.close_unfinished()
        self._finish(completion)

    async def _stream(self, gen: Generation, wire: Wire, completion: Completion, call) -> web.StreamResponse:
        """Headers go out with the first upstream message (so early upstream errors are plain HTTP
        errors) or with the first keep-alive, whichever comes first."""
        events = EventStream(self.request)
        opened = False
        try:
            async with aclosing(with_keepalive(self._messages(gen, call, completion),
                                               self.gw.config.upstream.keepalive_interval_s)) as messages:
                async for msg in messages:
                    if msg is KEEPALIVE:
                        await events.keepalive()
                        continue
                    if not opened:
                        events.queue_all(wire.opening())
                        opened = True
                    delta = completion.accept(msg)
                    if delta:
                        self._tick(gen.model)
                        events.queue_all(wire.delta(delta))
                    await events.send()    # what this message produced, in one write
            if not opened:
                events.queue_all(wire.opening())
            for delta in completion.close_unfinished():
                events.queue_all(wire.delta(delta))
            self._finish(completion)
            events.queue_all(wire.closing())
            if self.keeper is not None:   # the reply goes out before the store waits; otherwise with the end
                await events.send()
            await self._keep(completion)  # before the end of the stream: read-your-writes
        except ApiError as e:
            if not events.started:
                raise
            await events.send(sse_error_event(e))
        await events.done(wire.done)
        return events.response

    async def _keep(self, completion: Completion) -> None:
        """Runs the keeper once; the reply counts as partial unless the request ended normally."""
        outcome = self.outcome
        if self.keeper is None or outcome.kept:
            return
        if outcome.status == "error" and not completion.completion_tokens:
            return
        outcome.kept = True
        partial = outcome.status not in ("ok", "content_filter")
        failure = await asyncio.shield(self.gw.spawn(self._keep_once(completion, partial)))  # survives the client
        if failure is not None:
            raise failure

    async def _keep_once(self, completion: Completion, partial: bool) -> ApiError | None:
        try:
            await self.keeper.keep(self.gw, self.principal, completion, partial)
            return None
        except ApiError as e:    # the keeper counted and logged it
            return e

    async def _settle(self, gen: Generation, completion: Completion, ticket: Reservation) -> None:
        await self.gw.metering.settle(ticket, completion.id, completion.prompt_tokens, completion.completion_tokens,
                                      completion.cached_tokens, self.outcome.status)
        self.gw.metrics.model(gen.model).request_latency.observe(time.monotonic() - self.outcome.started)
        try:
            await self._keep(completion)
        except ApiError:
            pass   # counted and logged; nobody is left to tell

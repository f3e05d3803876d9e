"""POST /v1/chat/completions, whole and streamed.

Order of admission: key -> body -> model -> conversation history -> input safety -> rate limits
(reserve) -> overload slot -> upstream. Whatever way the request ends, its bookkeeping (rate-limit
reconcile, usage record, conversation append) runs in a task of its own, so a client that
went away still pays for what was produced and its partial reply is kept.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
from aiohttp import web
from opentelemetry import trace

from llmserve.v1 import worker_pb2
from services.gateway.app import GATEWAY, Gateway
from services.gateway.auth import Principal
from services.gateway.chat_request import ChatRequest, parse_chat_request
from services.gateway.completion import Completion
from services.gateway.conversation_resume import fit_history, messages_to_store
from services.gateway.errors import ApiError, sse_error_event
from services.gateway.limits import admit, estimate_prompt_tokens, limits_for, reservation
from services.gateway.metering import Reservation
from services.gateway.overload import Overloaded
from services.gateway.routes import read_json
from services.gateway.sse import KEEPALIVE, EventStream, with_keepalive
from services.gateway.tracing import grpc_metadata, set_request_attributes, set_response_attributes
from services.gateway.turn_store import ConversationNotStored, store_turn
from services.gateway.upstream import api_error_from_grpc

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """How the request ended, filled in as it runs."""
    status: str = "error"          # ok | content_filter | cancelled | error
    first_token_at: float | None = None
    last_token_at: float | None = None
    turn_stored: bool = False      # the conversation got this request's messages
    started: float = field(default_factory=time.monotonic)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    principal = await gw.auth.principal(request)
    req = parse_chat_request(await read_json(request))
    info = await gw.upstream.model(req.model)
    context = info.max_context_length
    if not context:   # the router knows the model, but none of its workers has reported yet
        raise ApiError(503, f"the model `{req.model}` has no worker ready yet; retry shortly",
                       code="upstream_unavailable", headers={"Retry-After": "1"})
    if req.max_tokens and req.max_tokens > context:
        raise ApiError(400, f"max_completion_tokens {req.max_tokens} exceeds the context of {req.model} "
                       f"({context} tokens)", param="max_completion_tokens", code="invalid_value")
    span = gw.tracer.start_span(f"chat {req.model}", kind=trace.SpanKind.CLIENT)
    try:
        set_request_attributes(span, req.model, req.max_tokens, req.conversation_id, req.temperature)
        metadata = grpc_metadata(span, request["request_id"])
        return await _admitted(request, gw, principal, req, context, span, metadata)
    except ApiError as e:
        span.set_attribute("error.type", e.code or str(e.status))
        raise
    finally:
        span.end()


async def _admitted(request: web.Request, gw: Gateway, principal: Principal, req: ChatRequest, context: int,
                    span: trace.Span, metadata: list[tuple[str, str]]) -> web.StreamResponse:
    org_id = principal.organization.id
    messages = [worker_pb2.ChatMessage(role=role, content=text) for role, text in req.messages]
    if req.conversation_id:
        stored = await gw.conversations.get(org_id, req.conversation_id)
        reply_room = req.max_tokens or gw.config.conversations.min_reply_tokens
        messages = await fit_history(gw.upstream, req.model, context, list(stored.messages), messages,
                                     reply_room, metadata)
    moderation = await gw.safety.check_input(org_id, [text for _, text in req.messages])
    if moderation.blocked:
        raise ApiError(400, "the input was rejected by the safety policy", param="messages",
                       code="content_policy_violation")
    if moderation.flagged:
        flagged = sorted(category for category, hit in moderation.categories.items() if hit)
        span.set_attribute("llmserve.safety.input_flagged", flagged)
        log.info("request %s: input flagged by rule %s", request["request_id"], moderation.matched_rule)

    prompt_estimate = estimate_prompt_tokens([m.content for m in messages], context)
    limits = limits_for(principal)
    reserved = reservation(prompt_estimate, req.n, req.max_tokens, context)
    decision = await admit(gw.limiter, limits, reserved)
    request["ratelimit_headers"] = decision.headers
    ticket = Reservation(principal, req.model, limits, reserved)
    try:
        async with gw.overload.admit(req.model):
            return await _run(request, gw, principal, req, messages, prompt_estimate, ticket, span, metadata)
    except Overloaded:
        gw.spawn(gw.metering.refund(ticket))
        raise


async def _run(request: web.Request, gw: Gateway, principal: Principal, req: ChatRequest,
               messages: list[worker_pb2.ChatMessage], prompt_estimate: int, ticket: Reservation,
               span: trace.Span, metadata: list[tuple[str, str]]) -> web.StreamResponse:
    org_id = principal.organization.id
    guards = [gw.safety.output_guard(org_id) for _ in range(req.n)]
    completion = Completion(req.model, req.n, guards, req.logprobs, prompt_estimate)
    outcome = Outcome()
    call = gw.upstream.generate(worker_pb2.GenerateRequest(
        request_id=completion.id, model=req.model, chat=worker_pb2.ChatPrompt(messages=messages),
        sampling=req.sampling(), cache_salt=org_id), metadata)
    try:
        if req.stream:
            return await _stream(request, gw, req, completion, call, outcome, principal)
        await _consume(gw, req, completion, call, outcome)
        await _store_turn(gw, req, completion, outcome, principal)  # before the reply: read-your-writes
        return web.json_response(completion.response())
    except (asyncio.CancelledError, ConnectionResetError):
        outcome.status = "cancelled"
        raise
    finally:
        call.cancel()  # no-op once the stream ended; otherwise aborts the request upstream at once
        set_response_attributes(span, req.model, completion.finish_reasons, completion.prompt_tokens,
                                completion.completion_tokens, completion.id)
        gw.spawn(_settle(gw, req, completion, outcome, ticket, principal))


async def _messages(call, completion: Completion):
    """Upstream messages until every choice is done (a content filter stops reading early)."""
    try:
        async for msg in call:
            yield msg
            if completion.finished and "content_filter" in completion.finish_reasons:
                return
    except grpc.aio.AioRpcError as e:
        raise api_error_from_grpc(e) from None


def _final_status(completion: Completion) -> str:
    return "content_filter" if "content_filter" in completion.finish_reasons else "ok"


def _tick(gw: Gateway, model: str, outcome: Outcome) -> None:
    now = time.monotonic()
    series = gw.metrics.model(model)
    if outcome.first_token_at is None:
        outcome.first_token_at = now
        series.ttft.observe(now - outcome.started)
    else:
        series.inter_token.observe(now - outcome.last_token_at)
    outcome.last_token_at = now


async def _consume(gw: Gateway, req: ChatRequest, completion: Completion, call, outcome: Outcome) -> None:
    async for msg in _messages(call, completion):
        if completion.accept(msg):
            _tick(gw, req.model, outcome)
    completion.close_unfinished()
    outcome.status = _final_status(completion)


async def _stream(request: web.Request, gw: Gateway, req: ChatRequest, completion: Completion, call,
                  outcome: Outcome, principal: Principal) -> web.StreamResponse:
    """Headers go out with the first upstream message (so early upstream errors are plain HTTP
    errors) or with the first keep-alive, whichever comes first."""
    events = EventStream(request)
    with_usage = req.include_usage
    roles_sent = False
    try:
        async with aclosing(with_keepalive(_messages(call, completion),
                                           gw.config.upstream.keepalive_interval_s)) as messages:
            async for msg in messages:
                if msg is KEEPALIVE:
                    await events.keepalive()
                    continue
                if not roles_sent:
                    events.queue(completion.chunk(completion.role_choices(), with_usage))
                    roles_sent = True
                delta = completion.accept(msg)
                if delta:
                    _tick(gw, req.model, outcome)
                    events.queue(completion.chunk([Completion.chunk_choice(delta)], with_usage))
                await events.send()    # what this message produced, in one write
        for delta in completion.close_unfinished():
            events.queue(completion.chunk([Completion.chunk_choice(delta)], with_usage))
        if with_usage:
            events.queue(completion.chunk([], True, completion.usage()))
        if req.conversation_id:   # the reply goes out before the store waits; otherwise with [DONE]
            await events.send()
        outcome.status = _final_status(completion)
        await _store_turn(gw, req, completion, outcome, principal)  # before [DONE]: read-your-writes
    except ApiError as e:
        if not events.started:
            raise
        await events.send(sse_error_event(e))
    await events.done()
    return events.response


async def _store_turn(gw: Gateway, req: ChatRequest, completion: Completion, outcome: Outcome,
                      principal: Principal) -> None:
    """Appends the new messages and the reply (choice 0) to the conversation, once; the reply is
    marked partial unless the request ended normally. Idempotent upstream by the completion id.
    Raises ConversationNotStored (already counted and logged) when the append failed for good."""
    if not req.conversation_id or outcome.turn_stored:
        return
    if outcome.status == "error" and not completion.completion_tokens:
        return
    outcome.turn_stored = True
    partial = outcome.status not in ("ok", "content_filter")
    reply = completion.choices[0].content
    failure = await asyncio.shield(gw.spawn(store_turn(  # survives the client going away
        gw, principal.organization.id, req.conversation_id,
        messages_to_store(req.messages, reply, req.model, partial), completion.id)))
    if failure is not None:
        raise failure


async def _settle(gw: Gateway, req: ChatRequest, completion: Completion, outcome: Outcome, ticket: Reservation,
                  principal: Principal) -> None:
    await gw.metering.settle(ticket, completion.id, completion.prompt_tokens, completion.completion_tokens,
                             completion.cached_tokens, outcome.status)
    gw.metrics.model(req.model).request_latency.observe(time.monotonic() - outcome.started)
    try:
        await _store_turn(gw, req, completion, outcome, principal)
    except ConversationNotStored:
        pass   # counted and logged; nobody is left to tell


def register(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)

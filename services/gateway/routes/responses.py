"""The Responses API: POST /v1/responses (whole and streamed), GET and DELETE /v1/responses/{id}.

A request goes through the shared pipeline like a chat completion (the input items become chat
messages, instructions a system message first). The reply is written as output items (a message
with output_text, function_call items), streamed as the event sequence the openai SDK parses.

Storage (store, true by default): a response is a conversation of kind "response" in the
conversations service, so it is private to the organization like any conversation. It is created
before generation (its id is the response's: resp_<uuid hex>) and holds the whole context up to
and including this response's output, one chat message per stored message (JSON content), the last
one carrying the response object. previous_response_id thus resolves with one read; instructions
are not carried over (as OpenAI documents).
"""

from __future__ import annotations

import json
import logging
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from llmserve.v1 import conversations_pb2, worker_pb2
from services.gateway.app import GATEWAY
from services.gateway.auth import Principal
from services.gateway.chat_request import SAMPLING_FIELDS, SamplingRequest, boolean, check_fields, integer, \
    parse_message, parse_model, parse_sampling
from services.gateway.completion import Completion, Delta, dumps
from services.gateway.errors import ApiError, invalid
from services.gateway.pipeline import Generation, Pipeline
from services.gateway.request_context import REQUEST_ID
from services.gateway.routes import read_json
from services.gateway.structured import OutputFormat, ToolUse, check_logit_bias, parse_response_format, parse_tools
from services.gateway.tool_calls import Parsed, ToolCallParser

log = logging.getLogger(__name__)
KIND = "response"
FIELDS = (SAMPLING_FIELDS - {"n", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias"}) | {
    "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "max_output_tokens",
    "store", "previous_response_id", "metadata", "top_logprobs", "truncation"}
IGNORED = {"user", "service_tier", "safety_identifier", "include", "reasoning", "background", "prompt_cache_retention"}


# -- ids -------------------------------------------------------------------------------------------

def response_id(conversation_id: str) -> str:
    return "resp_" + uuid.UUID(conversation_id).hex


def conversation_of(rid: str, param: str) -> str:
    """The stored conversation behind a response id; 404 for anything that cannot be one."""
    try:
        if rid.startswith("resp_"):
            return str(uuid.UUID(hex=rid[5:]))
    except ValueError:
        pass
    raise not_found(rid, param)


def not_found(rid: str, param: str) -> ApiError:
    return ApiError(404, f"Response with id '{rid[:80]}' not found.", param=param, code="response_not_found")


def item_id(prefix: str) -> str:
    return prefix + "_" + secrets.token_hex(16)


# -- stored messages: a chat message as JSON content ----------------------------------------------

def encode_message(m: worker_pb2.ChatMessage, response: dict | None = None) -> conversations_pb2.NewMessage:
    body: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        body["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls]
    if m.tool_call_id:
        body["tool_call_id"], body["name"] = m.tool_call_id, m.name
    if response is not None:
        body["response"] = response
    return conversations_pb2.NewMessage(role=m.role, content=dumps(body), model=response["model"] if response else "",
                                        partial=bool(response and response["status"] == "incomplete"))


def decode_message(stored: conversations_pb2.StoredMessage) -> tuple[worker_pb2.ChatMessage, dict | None]:
    body = json.loads(stored.content)
    message = worker_pb2.ChatMessage(
        role=body["role"], content=body["content"], tool_call_id=body.get("tool_call_id", ""),
        name=body.get("name", ""),
        tool_calls=[worker_pb2.ToolCall(**c) for c in body.get("tool_calls", [])])
    return message, body.get("response")


# -- the request -----------------------------------------------------------------------------------

@dataclass
class ResponsesRequest(SamplingRequest):
    input: list[worker_pb2.ChatMessage] = field(default_factory=list)
    instructions: str | None = None
    tools: ToolUse = field(default_factory=ToolUse)
    output: OutputFormat = field(default_factory=OutputFormat)
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    echo: dict[str, Any] = field(default_factory=dict)   # request fields the response object repeats


def _text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")


def parse_input(value: Any) -> list[worker_pb2.ChatMessage]:
    """Input text or items (messages, function_call, function_call_output) as chat messages;
    consecutive function_call items become one assistant message with several tool calls."""
    if isinstance(value, str):
        return [worker_pb2.ChatMessage(role="user", content=value)]
    if not isinstance(value, list) or not value:
        raise invalid("input must be a string or a non-empty array of input items", "input",
                      "missing_required_parameter" if value is None else "invalid_type")
    messages: list[worker_pb2.ChatMessage] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object", where, "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(parse_message({"role": item.get("role"), "content": item.get("content")}, where))
        elif kind == "function_call":
            call = worker_pb2.ToolCall(id=_required(item, "call_id", where), name=_required(item, "name", where),
                                       arguments=_string_field(item, "arguments", where))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                last.tool_calls.append(call)
            else:
                messages.append(worker_pb2.ChatMessage(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list) and all(_text_part(p) for p in output):
                output = "".join(p["text"] for p in output)
            if not isinstance(output, str):
                raise invalid(f"{where}.output must be a string", f"{where}.output", "invalid_type")
            messages.append(worker_pb2.ChatMessage(role="tool", content=output,
                                                   tool_call_id=_required(item, "call_id", where)))
        elif kind == "reasoning":
            continue   # no served model reasons in separate items; its summary is not context
        else:
            raise invalid(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)",
                          f"{where}.type", "unsupported_value")
    return messages


def _required(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise invalid(f"{where}.{name} is required (a string)", f"{where}.{name}", "missing_required_parameter")
    return value


def _string_field(item: dict, name: str, where: str) -> str:
    value = item.get(name, "")
    if not isinstance(value, str):
        raise invalid(f"{where}.{name} must be a string", f"{where}.{name}", "invalid_type")
    return value


def parse_responses_request(body: Any) -> ResponsesRequest:
    check_fields(body, FIELDS, IGNORED, {"conversation", "prompt", "max_tool_calls"})
    req = ResponsesRequest(model=parse_model(body))
    if "input" not in body:
        raise invalid("input is required", "input", "missing_required_parameter")
    req.input = parse_input(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions must be a string", "instructions", "invalid_type")
    req.instructions = instructions or None
    parse_sampling(body, req, ("max_output_tokens",))
    top = integer(body, "top_logprobs", 0, 20)
    if top:
        req.logprobs, req.top_logprobs = True, top
    req.tools = parse_tools(body, flat=True)
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise invalid("text must be an object ({format: ...})", "text", "invalid_type")
    req.output = parse_response_format((text or {}).get("format"), "text.format", flat=True)
    req.store = body.get("store") is not False
    if body.get("store") is not None:
        boolean(body, "store")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise invalid("previous_response_id must be a response id", "previous_response_id", "invalid_type")
    req.previous_response_id = previous
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()):
        raise invalid("metadata must map at most 16 keys (64 characters) to strings (512 characters)", "metadata",
                      "invalid_value")
    req.metadata = metadata
    truncation = body.get("truncation")
    if truncation not in (None, "disabled", "auto"):
        raise invalid("truncation must be disabled or auto", "truncation", "invalid_value")
    req.echo = {"instructions": req.instructions, "max_output_tokens": req.max_tokens,
                "parallel_tool_calls": req.tools.parallel, "previous_response_id": previous,
                "temperature": req.temperature, "top_p": req.top_p, "store": req.store, "metadata": metadata,
                "text": {"format": (text or {}).get("format") or {"type": "text"}},
                "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
                "truncation": truncation or "disabled", "user": body.get("user"),
                "prompt_cache_key": req.prompt_cache_key or None}
    return req


# -- the output --------------------------------------------------------------------------------------

class ResponsesWire:
    """Output items and the streamed event sequence over choice 0 of the Completion. The same
    builder serves a whole response (fed the whole text once) and a stream (fed per delta)."""
    done = b""    # the Responses stream ends with response.completed, not [DONE]

    def __init__(self, req: ResponsesRequest, completion: Completion, tool_format: str | None):
        self.req = req
        self.completion = completion
        function = req.tools.choice if req.tools.named else None
        self.parser = ToolCallParser(tool_format, function, req.tools.max_calls) if tool_format else None
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None     # the item receiving deltas
        self.sequence = 0
        self.status = "in_progress"
        self.fed = False                              # deltas were fed (a stream), not the whole text

    # events
    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {dumps(body)}\n\n".encode()

    def response_object(self) -> dict[str, Any]:
        c = self.completion
        usage = c.usage()
        finish = c.choices[0].finish_reason
        incomplete = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(finish or "")
        return {"id": c.id, "object": "response", "created_at": c.created, "status": self.status,
                "error": None, "incomplete_details": {"reason": incomplete} if incomplete and self.status != "in_progress"
                else None, "model": c.model, "output": self.items if self.status != "in_progress" else [],
                "reasoning": {"effort": None, "summary": None},
                "usage": {"input_tokens": usage["prompt_tokens"],
                          "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                          "output_tokens": usage["completion_tokens"],
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": usage["total_tokens"]} if self.status != "in_progress" else None,
                **self.req.echo}

    def opening(self) -> list[bytes]:
        return [self._event("response.created", response=self.response_object()),
                self._event("response.in_progress", response=self.response_object())]

    def _close_open(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=part["logprobs"]),
                      self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"])]
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _open_item(self, item: dict[str, Any]) -> list[bytes]:
        events = self._close_open()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        shown = {**item, "content": []} if item["type"] == "message" else {**item, "status": "in_progress"}
        events.append(self._event("response.output_item.added", output_index=index, item=shown))
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                             "logprobs": []}))
        return events

    def _apply(self, parsed: Parsed, logprobs: list[dict] | None) -> list[bytes]:
        events: list[bytes] = []
        if parsed.content:
            if self.open is None or self.open["type"] != "message":
                events += self._open_item({"type": "message", "id": item_id("msg"), "status": "in_progress",
                                           "role": "assistant", "content": [{"type": "output_text", "text": "",
                                                                            "annotations": [], "logprobs": []}]})
            part = self.open["content"][0]
            part["text"] += parsed.content
            entries = [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                        "top_logprobs": e["top_logprobs"]} for e in logprobs or []]
            part["logprobs"].extend(entries)
            events.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                      output_index=len(self.items) - 1, content_index=0, delta=parsed.content,
                                      logprobs=entries))
        for call in parsed.calls:
            if call.name is not None:
                events += self._open_item({"type": "function_call", "id": item_id("fc"), "call_id": call.id,
                                           "name": call.name, "arguments": "", "status": "in_progress"})
            if call.arguments:
                self.open["arguments"] += call.arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                          output_index=len(self.items) - 1, delta=call.arguments))
        return events

    def _feed(self, text: str, finished: bool, logprobs: list[dict] | None = None) -> list[bytes]:
        if self.parser is None:
            parsed = Parsed(content=text)
        else:
            parsed = self.parser.feed(text) if text else Parsed()
            if finished:
                parsed.content += self.parser.finish().content
        return self._apply(parsed, logprobs)

    def delta(self, delta: Delta) -> list[bytes]:
        if delta.index != 0:
            return []
        self.fed = True
        return self._feed(delta.text, bool(delta.finish_reason), delta.logprobs)

    def _finish(self) -> list[bytes]:
        events = self._close_open()
        finish = self.completion.choices[0].finish_reason
        self.status = "incomplete" if finish in ("length", "content_filter") else "completed"
        return events

    def closing(self) -> list[bytes]:
        events = self._finish()
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return events + [self._event(kind, response=self.response_object())]

    def body(self) -> dict[str, Any]:
        """The whole response; after a stream cut short, what it had produced."""
        if self.status == "in_progress":
            self._feed("" if self.fed else self.completion.choices[0].content, True)
            self._finish()
        return self.response_object()


@dataclass
class StoredResponse:
    """The keeper of a stored response: the whole context and the output, in its conversation."""
    conversation_id: str
    context: list[worker_pb2.ChatMessage]       # previous context and this request's input
    wire: ResponsesWire

    async def keep(self, gw, principal: Principal, completion: Completion, partial: bool) -> None:
        response = self.wire.body()
        if partial:
            response = {**response, "status": "incomplete"}
        output = worker_pb2.ChatMessage(role="assistant", content=completion.choices[0].content)
        messages = [encode_message(m) for m in self.context] + [encode_message(output, response)]
        most = 64   # the conversations service's messages per append
        try:
            for start in range(0, len(messages), most):
                await gw.conversations.append(principal.organization.id, self.conversation_id,
                                              messages[start:start + most], f"{completion.id}:{start}")
        except ApiError as e:
            gw.metrics.conversation_store_failures.labels(code=e.code or str(e.status)).inc()
            log.error("request %s: response %s NOT stored: %s", REQUEST_ID.get(), completion.id, e.message)
            raise


# -- handlers --------------------------------------------------------------------------------------

async def _stored(gw, org_id: str, rid: str, param: str) -> conversations_pb2.Conversation:
    conversation_id = conversation_of(rid, param)
    try:
        conversation = await gw.conversations.get(org_id, conversation_id)
    except ApiError as e:
        if e.status == 404:
            raise not_found(rid, param) from None
        raise
    if conversation.kind != KIND or not conversation.messages:
        raise not_found(rid, param)
    return conversation


async def create_response(request: web.Request) -> web.StreamResponse:
    pipeline = await Pipeline.open(request)
    gw = pipeline.gw
    req = parse_responses_request(await read_json(request))
    info = await pipeline.model(req.model, req.max_tokens, "max_output_tokens")
    check_logit_bias(req.logit_bias, info.vocab_size)
    context: list[worker_pb2.ChatMessage] = []
    if req.previous_response_id:
        previous = await _stored(gw, pipeline.org_id, req.previous_response_id, "previous_response_id")
        context = [decode_message(m)[0] for m in previous.messages]
    context += req.input
    system = [worker_pb2.ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    gen = Generation(model=req.model, sampling=req.sampling(), chat=system + context, stream=req.stream,
                     tools_json=req.tools.tools_json(), constraint=req.tools.constraint() or req.output.constraint,
                     constraint_param="tools" if req.tools.constraint() else req.output.param,
                     max_tokens=req.max_tokens, logprobs=req.logprobs,
                     moderated=[m.content for m in system + req.input if m.role in ("user", "system")],
                     affinity_key=req.prompt_cache_key, temperature=req.temperature)
    stored_id = ""
    if req.store:
        created = await gw.conversations.create(pipeline.org_id, "", req.model, {}, kind=KIND)
        stored_id, gen.id = created.id, response_id(created.id)
    else:
        gen.id = "resp_" + uuid.uuid4().hex
    tool_format = req.tools.parser_format(info.tool_call_format)
    wires: list[ResponsesWire] = []

    def wire_for(completion: Completion) -> ResponsesWire:
        wires.append(ResponsesWire(req, completion, tool_format))
        if stored_id:
            pipeline.keeper = StoredResponse(stored_id, context, wires[0])
        return wires[0]

    try:
        return await pipeline.run(gen, wire_for)
    except ApiError:
        if stored_id and not pipeline.produced:   # refused or failed before any output: nothing is kept
            gw.spawn(gw.conversations.delete(pipeline.org_id, stored_id))
        raise


async def get_response(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    principal = await gw.auth.principal(request)
    rid = request.match_info["response_id"]
    conversation = await _stored(gw, principal.organization.id, rid, "response_id")
    _, response = decode_message(conversation.messages[-1])
    if response is None:
        raise not_found(rid, "response_id")
    return web.json_response(response)


def input_items(m: worker_pb2.ChatMessage, seq: int) -> list[dict[str, Any]]:
    """One stored context message as Responses input items (ids stable by position)."""
    if m.role == "tool":
        return [{"type": "function_call_output", "id": f"fco_{seq}", "call_id": m.tool_call_id, "output": m.content,
                 "status": "completed"}]
    items = []
    if m.content or not m.tool_calls:
        part = {"type": "output_text", "text": m.content, "annotations": []} if m.role == "assistant" else \
            {"type": "input_text", "text": m.content}
        items.append({"type": "message", "id": f"msg_{seq}", "role": m.role, "status": "completed", "content": [part]})
    items += [{"type": "function_call", "id": f"fc_{seq}_{j}", "call_id": c.id, "name": c.name,
               "arguments": c.arguments, "status": "completed"} for j, c in enumerate(m.tool_calls)]
    return items


async def list_input_items(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}/input_items: the context the response was generated from
    (previous responses' turns and its own input), order desc by default, limit and after."""
    gw = request.app[GATEWAY]
    principal = await gw.auth.principal(request)
    rid = request.match_info["response_id"]
    conversation = await _stored(gw, principal.organization.id, rid, "response_id")
    items = [item for m in conversation.messages[:-1] for item in input_items(decode_message(m)[0], m.seq)]
    query = request.query
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order must be asc or desc", "order", "invalid_value")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise invalid("limit must be an integer in [1, 100]", "limit", "invalid_value")
    if order == "desc":
        items.reverse()
    if "after" in query:
        ids = [i["id"] for i in items]
        if query["after"] not in ids:
            raise invalid(f"after: no item {query['after'][:64]!r} in this response's input", "after",
                          "invalid_value")
        items = items[ids.index(query["after"]) + 1:]
    page = items[:limit]
    return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


async def delete_response(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    principal = await gw.auth.principal(request)
    rid = request.match_info["response_id"]
    conversation = await _stored(gw, principal.organization.id, rid, "response_id")
    await gw.conversations.delete(principal.organization.id, conversation.id)
    return web.json_response({"id": rid, "object": "response", "deleted": True})


def register(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)

"""POST /v1/chat/completions, whole and streamed: parses the body and formats the output; the
request itself goes through the shared pipeline (pipeline.py)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.gateway.auth import Principal
from services.gateway.chat_request import ChatRequest, parse_chat_request
from services.gateway.completion import Completion, Delta, dumps
from services.gateway.conversation_resume import messages_to_store
from services.gateway.pipeline import Generation, Pipeline
from services.gateway.routes import read_json
from services.gateway.sse import DONE
from services.gateway.structured import check_logit_bias
from services.gateway.tool_calls import Parsed, ToolCallParser, parse_whole
from services.gateway.turn_store import store_turn


def tool_finish(reason: str | None, calls: bool) -> str | None:
    """A choice that stopped after calling tools finishes with tool_calls."""
    return "tool_calls" if calls and reason == "stop" else reason


class ChatWire:
    """chat.completion(.chunk) objects over the Completion; with tools, each choice's text goes
    through its tool-call parser (content and tool_calls deltas out)."""
    done = DONE

    def __init__(self, req: ChatRequest, completion: Completion, tool_format: str | None):
        self.req = req
        self.completion = completion
        self.tool_format = tool_format
        self.function = req.tools.choice if req.tools.named else None
        self.parsers = [ToolCallParser(tool_format, self.function, req.tools.max_calls) for _ in completion.choices] \
            if tool_format else []

    def opening(self) -> list[bytes]:
        return [self.completion.chunk(self.completion.role_choices(), self.req.include_usage)]

    def delta(self, delta: Delta) -> list[bytes]:
        if not self.parsers:
            return [self.completion.chunk([Completion.chunk_choice(delta)], self.req.include_usage)]
        parser = self.parsers[delta.index]
        parsed = parser.feed(delta.text) if delta.text else Parsed()
        if delta.finish_reason:
            tail = parser.finish()
            parsed.content += tail.content
        if not parsed and not delta.finish_reason and delta.logprobs is None:
            return []
        body: dict[str, Any] = {}
        if parsed.content:
            body["content"] = parsed.content
        if parsed.calls:
            body["tool_calls"] = [c.entry() for c in parsed.calls]
        choice = {"index": delta.index, "delta": body,
                  "logprobs": None if delta.logprobs is None else {"content": delta.logprobs},
                  "finish_reason": tool_finish(delta.finish_reason, bool(parser.calls))}
        return [self.completion.chunk([dumps(choice)], self.req.include_usage)]

    def closing(self) -> list[bytes]:
        if not self.req.include_usage:
            return []
        return [self.completion.chunk([], True, self.completion.usage())]

    def body(self) -> dict[str, Any]:
        response = self.completion.response()
        if not self.tool_format:
            return response
        for choice, out in zip(self.completion.choices, response["choices"]):
            content, calls = parse_whole(self.tool_format, choice.content, self.function, self.req.tools.max_calls)
            if calls:
                out["message"]["content"] = content or None
                out["message"]["tool_calls"] = [c.message_entry() for c in calls]
                out["finish_reason"] = tool_finish(out["finish_reason"], True)
        return response


class ConversationTurn:
    """Appends the new messages and the reply (choice 0) to the conversation; idempotent upstream
    by the completion id. A failed append raises ConversationNotStored (already counted and logged)."""

    def __init__(self, req: ChatRequest):
        self.req = req

    async def keep(self, gw, principal: Principal, completion: Completion, partial: bool) -> None:
        reply = completion.choices[0].content
        failure = await store_turn(gw, principal.organization.id, self.req.conversation_id,
                                   messages_to_store(self.req.messages, reply, self.req.model, partial), completion.id)
        if failure is not None:
            raise failure


async def chat_completions(request: web.Request) -> web.StreamResponse:
    pipeline = await Pipeline.open(request)
    req = parse_chat_request(await read_json(request))
    info = await pipeline.model(req.model, req.max_tokens)
    check_logit_bias(req.logit_bias, info.vocab_size)
    gen = Generation(model=req.model, sampling=req.sampling(), chat=req.chat_messages(), stream=req.stream,
                     tools_json=req.tools.tools_json(), constraint=req.constraint(),
                     constraint_param=req.constraint_param(), max_tokens=req.max_tokens, logprobs=req.logprobs,
                     moderated=[text for _, text in req.messages], history_conversation=req.conversation_id,
                     affinity_key=req.prompt_cache_key, temperature=req.temperature)
    if req.conversation_id:
        pipeline.keeper = ConversationTurn(req)
    tool_format = req.tools.parser_format(info.tool_call_format)
    return await pipeline.run(gen, lambda completion: ChatWire(req, completion, tool_format))


def register(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)

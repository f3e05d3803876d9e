"""Validates a /v1/chat/completions body into a ChatRequest, naming the offending param on error.

Fields the platform cannot honour are refused with a 400, never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmserve.v1 import worker_pb2
from services.gateway.errors import invalid

MAX_N = 16
MAX_STOP = 4
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# Accepted and ignored: they change nothing about the answer.
IGNORED = {"user", "metadata", "service_tier", "store", "parallel_tool_calls"}
UNSUPPORTED = {"tools", "tool_choice", "functions", "function_call", "logit_bias", "modalities", "audio",
               "prediction", "web_search_options", "reasoning_effort", "verbosity", "prompt_cache_key",
               "safety_identifier"}


@dataclass
class ChatRequest:
    model: str
    messages: list[tuple[str, str]]          # (role, text), roles normalised
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    conversation_id: str | None = None

    def sampling(self) -> worker_pb2.SamplingParams:
        params = worker_pb2.SamplingParams(
            max_tokens=self.max_tokens or 0, n=self.n, stop=self.stop, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logprobs=self.logprobs, top_logprobs=self.top_logprobs)
        if self.temperature is not None:
            params.temperature = self.temperature
        if self.top_p is not None:
            params.top_p = self.top_p
        if self.seed is not None:
            params.seed = self.seed
        return params


def _number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{name} must be a number", name, "invalid_type")
    if not (lo < value if lo_open else lo <= value) or value > hi:
        raise invalid(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", name, "invalid_value")
    return float(value)


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer", name, "invalid_type")
    if not lo <= value <= hi:
        raise invalid(f"{name} must be in [{lo}, {hi}], got {value}", name, "invalid_value")
    return value


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"{name} must be a boolean", name, "invalid_type")
    return value


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{where}[{i}]: only text content parts are supported", f"{where}[{i}]",
                              "unsupported_value")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"{where} must be a string or a list of text parts", where, "invalid_type")


def parse_messages(messages: Any, *, allow_empty: bool = False) -> list[tuple[str, str]]:
    if not isinstance(messages, list) or (not messages and not allow_empty):
        raise invalid("messages must be a non-empty array", "messages",
                      "invalid_type" if not isinstance(messages, list) else "invalid_value")
    parsed = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object", where, "invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role must be one of {sorted(ROLES)}", f"{where}.role", "invalid_value")
        for unsupported in ("tool_calls", "function_call", "audio"):
            if message.get(unsupported) is not None:
                raise invalid(f"{where}.{unsupported} is not supported", f"{where}.{unsupported}",
                              "unsupported_parameter")
        if "content" not in message or message["content"] is None:
            raise invalid(f"{where}.content is required", f"{where}.content", "missing_required_parameter")
        parsed.append((ROLES[role], _content(message["content"], f"{where}.content")))
    return parsed


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    for name, value in body.items():
        if name in UNSUPPORTED and value not in (None, [], {}):
            raise invalid(f"{name} is not supported by this server", name, "unsupported_parameter")
        if name not in ChatRequest.__dataclass_fields__ and name not in IGNORED and name not in UNSUPPORTED \
                and name not in ("max_completion_tokens", "stream_options", "response_format"):
            raise invalid(f"unrecognized request argument: {name}", name, "unknown_parameter")

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required (a string)", "model",
                      "missing_required_parameter" if model is None else "invalid_type")
    conversation_id = body.get("conversation_id")
    if conversation_id is not None and (not isinstance(conversation_id, str) or not conversation_id):
        raise invalid("conversation_id must be a non-empty string", "conversation_id", "invalid_type")
    if "messages" not in body:
        raise invalid("messages is required", "messages", "missing_required_parameter")
    req = ChatRequest(model=model, messages=parse_messages(body["messages"]), conversation_id=conversation_id)

    req.stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not req.stream:
            raise invalid("stream_options is only allowed with stream: true", "stream_options", "invalid_value")
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise invalid("stream_options supports only include_usage", "stream_options", "invalid_value")
        req.include_usage = _boolean(options, "include_usage")

    for name in ("max_completion_tokens", "max_tokens"):
        value = _integer(body, name, 1, 1 << 31)
        if value is not None:
            req.max_tokens = value
            break
    req.temperature = _number(body, "temperature", 0, 2)
    req.top_p = _number(body, "top_p", 0, 1, lo_open=True)
    req.n = _integer(body, "n", 1, MAX_N) or 1
    req.seed = _integer(body, "seed", -(1 << 63), (1 << 63) - 1)
    req.presence_penalty = _number(body, "presence_penalty", -2, 2) or 0.0
    req.frequency_penalty = _number(body, "frequency_penalty", -2, 2) or 0.0
    req.logprobs = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, 20)
    if top is not None:
        if not req.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        req.top_logprobs = top

    stop = body.get("stop")
    if isinstance(stop, str):
        req.stop = [stop]
    elif isinstance(stop, list):
        if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
            raise invalid(f"stop must be a string or up to {MAX_STOP} non-empty strings", "stop", "invalid_value")
        req.stop = stop
    elif stop is not None:
        raise invalid("stop must be a string or an array of strings", "stop", "invalid_type")

    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or "type" not in response_format:
            raise invalid("response_format must be an object with a type", "response_format", "invalid_type")
        if response_format["type"] != "text":
            raise invalid(f"response_format type {response_format['type']!r} is not supported (only 'text')",
                          "response_format", "unsupported_value")
    if body.get("store") not in (None, False):
        raise invalid("store: true is not supported", "store", "unsupported_value")
    return req

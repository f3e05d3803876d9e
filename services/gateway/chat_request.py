"""Validates a /v1/chat/completions body into a ChatRequest, naming the offending param on error.

Fields the platform cannot honour are refused with a 400, never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmserve.v1 import worker_pb2
from services.gateway.errors import invalid
from services.gateway.structured import OutputFormat, ToolUse, output_format, parse_logit_bias, parse_tools

MAX_N = 16
MAX_STOP = 4
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# Accepted and ignored: they change nothing about the answer.
IGNORED = {"user", "metadata", "service_tier", "store", "safety_identifier", "reasoning_effort", "verbosity"}
UNSUPPORTED = {"functions", "function_call", "modalities", "audio", "prediction", "web_search_options"}
# vLLM's sampling extensions (the openai SDK sends them in extra_body): benchmarks and agent
# frameworks written against vLLM pass them, and the worker's sampler implements each.
ENGINE_SAMPLING_FIELDS = {"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids"}
SAMPLING_FIELDS = {"model", "stream", "stream_options", "temperature", "top_p", "n", "stop", "seed",
                   "presence_penalty", "frequency_penalty", "logit_bias", "prompt_cache_key"} | ENGINE_SAMPLING_FIELDS
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "max_completion_tokens", "max_tokens", "logprobs", "top_logprobs",
                                 "conversation_id", "response_format", "structured_outputs", "tools", "tool_choice",
                                 "parallel_tool_calls"}
# Content parts a text model cannot read: refused by name rather than dropped.
NON_TEXT_PARTS = {"image_url": "image", "input_image": "image", "input_audio": "audio", "file": "file",
                  "input_file": "file"}


@dataclass
class SamplingRequest:
    """The fields chat completions, completions and responses share."""
    model: str = ""
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
    logit_bias: dict[int, float] = field(default_factory=dict)
    prompt_cache_key: str = ""
    top_k: int = 0                        # 0: off
    min_p: float = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def sampling(self) -> worker_pb2.SamplingParams:
        params = worker_pb2.SamplingParams(
            max_tokens=self.max_tokens or 0, n=self.n, stop=self.stop, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logprobs=self.logprobs, top_logprobs=self.top_logprobs,
            logit_bias=self.logit_bias, top_k=self.top_k, min_p=self.min_p, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids)
        if self.repetition_penalty is not None:
            params.repetition_penalty = self.repetition_penalty
        if self.temperature is not None:
            params.temperature = self.temperature
        if self.top_p is not None:
            params.top_p = self.top_p
        if self.seed is not None:
            params.seed = self.seed
        return params


@dataclass
class ChatRequest(SamplingRequest):
    messages: list[tuple[str, str]] = field(default_factory=list)   # (role, text), roles normalised
    conversation_id: str | None = None
    chat: list[worker_pb2.ChatMessage] = field(default_factory=list)   # what the template renders
    tools: ToolUse = field(default_factory=ToolUse)
    output: OutputFormat = field(default_factory=OutputFormat)

    def chat_messages(self) -> list[worker_pb2.ChatMessage]:
        return list(self.chat) or [worker_pb2.ChatMessage(role=role, content=text) for role, text in self.messages]

    def constraint(self) -> worker_pb2.Constraint | None:
        """A forced tool call (required, named) wins over response_format: its output is the call."""
        return self.tools.constraint() or self.output.constraint

    def constraint_param(self) -> str:
        return "tools" if self.tools.constraint() is not None else self.output.param


def number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{name} must be a number", name, "invalid_type")
    if not (lo < value if lo_open else lo <= value) or value > hi:
        raise invalid(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", name, "invalid_value")
    return float(value)


def integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer", name, "invalid_type")
    if not lo <= value <= hi:
        raise invalid(f"{name} must be in [{lo}, {hi}], got {value}", name, "invalid_value")
    return value


def boolean(body: dict, name: str) -> bool:
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
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in NON_TEXT_PARTS:
                raise invalid(f"{where}[{i}]: {NON_TEXT_PARTS[kind]} content ({kind}) is not supported: the served "
                              "models read text only", f"{where}[{i}]", "unsupported_value")
            if kind not in ("text", "input_text", "output_text") or not isinstance(part.get("text"), str):
                raise invalid(f"{where}[{i}]: only text content parts are supported", f"{where}[{i}]",
                              "unsupported_value")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"{where} must be a string or a list of text parts", where, "invalid_type")


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"{where} must be a non-empty string", where,
                      "missing_required_parameter" if value is None else "invalid_type")
    return value


def _tool_calls(calls: Any, where: str) -> list[worker_pb2.ToolCall]:
    if not isinstance(calls, list):
        raise invalid(f"{where} must be an array", where, "invalid_type")
    parsed = []
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function" \
                or not isinstance(call.get("function"), dict):
            raise invalid(f"{at} must be a function call ({{id, type: function, function: {{name, arguments}}}})",
                          at, "invalid_type")
        function = call["function"]
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            raise invalid(f"{at}.function.arguments must be a string (JSON text)", f"{at}.function.arguments",
                          "invalid_type")
        parsed.append(worker_pb2.ToolCall(id=_string(call.get("id"), f"{at}.id"),
                                          name=_string(function.get("name"), f"{at}.function.name"),
                                          arguments=arguments))
    return parsed


def parse_message(message: Any, where: str) -> worker_pb2.ChatMessage:
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object", where, "invalid_type")
    role = message.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role must be one of {sorted(ROLES)}", f"{where}.role", "invalid_value")
    for unsupported in ("function_call", "audio"):
        if message.get(unsupported) is not None:
            raise invalid(f"{where}.{unsupported} is not supported", f"{where}.{unsupported}",
                          "unsupported_parameter")
    calls = []
    if message.get("tool_calls") is not None:
        if role != "assistant":
            raise invalid(f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls",
                          "invalid_value")
        calls = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
    content = message.get("content")
    if content is None and not calls:
        raise invalid(f"{where}.content is required", f"{where}.content", "missing_required_parameter")
    parsed = worker_pb2.ChatMessage(role=ROLES[role], content=_content(content, f"{where}.content")
                                    if content is not None else "", tool_calls=calls)
    if role == "tool":
        parsed.tool_call_id = _string(message.get("tool_call_id"), f"{where}.tool_call_id")
        if isinstance(message.get("name"), str):
            parsed.name = message["name"]
    return parsed


def parse_chat_messages(messages: Any, *, allow_empty: bool = False) -> list[worker_pb2.ChatMessage]:
    if not isinstance(messages, list) or (not messages and not allow_empty):
        raise invalid("messages must be a non-empty array", "messages",
                      "invalid_type" if not isinstance(messages, list) else "invalid_value")
    return [parse_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def parse_chat_request(body: Any) -> ChatRequest:
    check_fields(body, CHAT_FIELDS)
    model = parse_model(body)
    conversation_id = body.get("conversation_id")
    if conversation_id is not None and (not isinstance(conversation_id, str) or not conversation_id):
        raise invalid("conversation_id must be a non-empty string", "conversation_id", "invalid_type")
    if "messages" not in body:
        raise invalid("messages is required", "messages", "missing_required_parameter")
    chat = parse_chat_messages(body["messages"])
    req = ChatRequest(model=model, messages=[(m.role, m.content) for m in chat], conversation_id=conversation_id,
                      chat=chat)

    parse_sampling(body, req, ("max_completion_tokens", "max_tokens"))
    req.logprobs = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", 0, 20)
    if top is not None:
        if not req.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        req.top_logprobs = top
    req.output = output_format(body)
    req.tools = parse_tools(body)
    if body.get("store") not in (None, False):
        raise invalid("store: true is not supported on chat completions (use /v1/responses)", "store",
                      "unsupported_value")
    return req


def check_fields(body: Any, known: set[str], ignored: set[str] = IGNORED, unsupported: set[str] = UNSUPPORTED
                 ) -> None:
    """Refuses what the platform cannot honour by name, and names it when unknown."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    for name, value in body.items():
        if name in unsupported and value not in (None, [], {}):
            raise invalid(f"{name} is not supported by this server", name, "unsupported_parameter")
        if name not in known and name not in ignored and name not in unsupported:
            raise invalid(f"unrecognized request argument: {name}", name, "unknown_parameter")


def parse_model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required (a string)", "model",
                      "missing_required_parameter" if model is None else "invalid_type")
    return model


def parse_sampling(body: dict, req: SamplingRequest, max_token_names: tuple[str, ...]) -> None:
    """stream, stream_options, max tokens (the first of max_token_names given), temperature, top_p,
    n, seed, penalties, stop, logit_bias, prompt_cache_key and vLLM's extensions, into req."""
    req.stream = boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not req.stream:
            raise invalid("stream_options is only allowed with stream: true", "stream_options", "invalid_value")
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise invalid("stream_options supports only include_usage", "stream_options", "invalid_value")
        req.include_usage = boolean(options, "include_usage")
    for name in max_token_names:
        value = integer(body, name, 1, 1 << 31)
        if value is not None:
            req.max_tokens = value
            break
    req.temperature = number(body, "temperature", 0, 2)
    req.top_p = number(body, "top_p", 0, 1, lo_open=True)
    req.n = integer(body, "n", 1, MAX_N) or 1
    req.seed = integer(body, "seed", -(1 << 63), (1 << 63) - 1)
    req.presence_penalty = number(body, "presence_penalty", -2, 2) or 0.0
    req.frequency_penalty = number(body, "frequency_penalty", -2, 2) or 0.0
    stop = body.get("stop")
    if isinstance(stop, str):
        req.stop = [stop]
    elif isinstance(stop, list):
        if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
            raise invalid(f"stop must be a string or up to {MAX_STOP} non-empty strings", "stop", "invalid_value")
        req.stop = stop
    elif stop is not None:
        raise invalid("stop must be a string or an array of strings", "stop", "invalid_type")
    req.logit_bias = parse_logit_bias(body.get("logit_bias"), 0)
    key = body.get("prompt_cache_key")
    if key is not None and not isinstance(key, str):
        raise invalid("prompt_cache_key must be a string", "prompt_cache_key", "invalid_type")
    req.prompt_cache_key = key or ""
    parse_engine_sampling(body, req)


MAX_STOP_TOKEN_IDS = 64
TOKEN_ID_MAX = (1 << 31) - 1


def parse_engine_sampling(body: dict, req: SamplingRequest) -> None:
    """vLLM's extensions, with vLLM's ranges (top_k -1 is its old spelling of off). Token ids are
    checked against the vocabulary by the worker, which knows it."""
    top_k = integer(body, "top_k", -1, TOKEN_ID_MAX)
    req.top_k = max(top_k or 0, 0)
    req.min_p = number(body, "min_p", 0, 1) or 0.0
    req.repetition_penalty = number(body, "repetition_penalty", 0, 10, lo_open=True)
    req.min_tokens = integer(body, "min_tokens", 0, 1 << 31) or 0
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise invalid(f"min_tokens ({req.min_tokens}) must not exceed the maximum tokens ({req.max_tokens})",
                      "min_tokens", "invalid_value")
    req.ignore_eos = boolean(body, "ignore_eos")
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= TOKEN_ID_MAX for t in ids):
            raise invalid(f"stop_token_ids must be an array of up to {MAX_STOP_TOKEN_IDS} token ids (integers >= 0)",
                          "stop_token_ids", "invalid_value")
        req.stop_token_ids = ids

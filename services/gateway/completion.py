"""One chat completion's output: upstream GenerateResponse messages in, OpenAI choices out.

Each choice's text passes through the safety output guard, which may hold back a little text (so a
match split across messages is caught) and may end the choice with finish_reason content_filter.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from llmserve.v1 import worker_pb2
from services.gateway.errors import ApiError

FINISH_REASONS = {worker_pb2.FINISH_REASON_STOP: "stop", worker_pb2.FINISH_REASON_LENGTH: "length"}
# Compact JSON with UTF-8 text as is; one encoder, not one per json.dumps call.
_dumps = dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def new_completion_id(prefix: str = "chatcmpl-") -> str:
    return prefix + secrets.token_urlsafe(18)


def logprob_entry(lp: worker_pb2.TokenLogprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.bytes),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}
                             for t in lp.top_logprobs]}


@dataclass
class Delta:
    """What one choice gained from one upstream message."""
    index: int
    text: str
    logprobs: list[dict[str, Any]] | None
    finish_reason: str | None


@dataclass
class Choice:
    index: int
    guard: Any                                   # the safety policy's output guard
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    tokens: int = 0

    @property
    def content(self) -> str:
        return "".join(self.text)

    def close(self, reason: str) -> str:
        """Ends the choice, releasing the guard's held-back tail (unless that tail is blocked)."""
        tail = self.guard.finish()
        self.text.append(tail)
        self.finish_reason = "content_filter" if self.guard.blocked else reason
        return tail


class Completion:
    def __init__(self, model: str, n: int, guards: list[Any], logprobs: bool, prompt_tokens_estimate: int,
                 id_prefix: str = "chatcmpl-", completion_id: str = ""):
        self.id = completion_id or new_completion_id(id_prefix)
        self.created = int(time.time())
        self.model = model
        self.logprobs = logprobs
        self.choices = [Choice(i, guards[i]) for i in range(n)]
        # Until the upstream's usage arrives (it may never: a stream cut short), the prompt is the
        # estimate and the completion is the tokens seen; a client that left pays for those.
        self.prompt_tokens = prompt_tokens_estimate
        self.cached_tokens = 0
        self._reported_completion_tokens: int | None = None
        # Every chunk repeats id, object, created, model and system_fingerprint: encoded once here.
        head = _dumps({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": model,
                       "system_fingerprint": None})
        self._chunk_head = "data: " + head[:-1] + ',"choices":['

    @property
    def finished(self) -> bool:
        return all(c.finish_reason for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        if self._reported_completion_tokens is not None:
            return self._reported_completion_tokens
        return sum(c.tokens for c in self.choices)

    @property
    def finish_reasons(self) -> list[str]:
        return [c.finish_reason or "incomplete" for c in self.choices]

    def accept(self, msg: worker_pb2.GenerateResponse) -> Delta | None:
        """Applies one upstream message; returns the delta to send, if any."""
        if msg.HasField("usage"):
            self.prompt_tokens = msg.usage.prompt_tokens
            self.cached_tokens = msg.usage.cached_prompt_tokens
            self._reported_completion_tokens = msg.usage.completion_tokens
        if msg.index >= len(self.choices):
            raise ApiError(502, f"upstream sent choice {msg.index} of {len(self.choices)}", type="server_error",
                           code="upstream_error")
        choice = self.choices[msg.index]
        if choice.finish_reason:                 # stopped by the safety guard; the rest is dropped
            return None
        choice.tokens += len(msg.token_ids)
        if msg.finish_reason == worker_pb2.FINISH_REASON_ABORT:
            raise ApiError(503, "the generation was aborted upstream", code="upstream_aborted",
                           headers={"Retry-After": "1"})
        emit, blocked = choice.guard.feed(msg.text) if msg.text else ("", None)
        choice.text.append(emit)
        if blocked is not None:
            choice.finish_reason = "content_filter"
        elif msg.finish_reason:
            emit += choice.close(FINISH_REASONS.get(msg.finish_reason, "stop"))
        logprobs = [logprob_entry(lp) for lp in msg.logprobs] if self.logprobs else None
        if logprobs:
            choice.logprobs.extend(logprobs)
        if not emit and not choice.finish_reason and not logprobs:
            return None
        return Delta(choice.index, emit, logprobs, choice.finish_reason)

    def close_unfinished(self) -> list[Delta]:
        """Choices the stream ended without a finish reason: release their held-back text."""
        return [Delta(c.index, c.close("stop"), None, c.finish_reason) for c in self.choices if not c.finish_reason]

    def usage(self) -> dict[str, Any]:
        completion = self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def chunk(self, choices: list[str], include_usage: bool, usage: dict | None = None) -> bytes:
        """One SSE event `data: {chunk}\n\n`; choices already encoded (chunk_choice, role_choices)."""
        tail = '],"usage":' + _dumps(usage) + "}\n\n" if include_usage else "]}\n\n"
        return (self._chunk_head + ",".join(choices) + tail).encode()

    @staticmethod
    def chunk_choice(delta: Delta) -> str:
        """One delta as an encoded choice. Runs per token: only its text is encoded in the usual case."""
        content = '{"content":' + _dumps(delta.text) + "}" if delta.text else "{}"
        logprobs = "null" if delta.logprobs is None else '{"content":' + _dumps(delta.logprobs) + "}"
        finish = "null" if delta.finish_reason is None else _dumps(delta.finish_reason)
        return f'{{"index":{delta.index},"delta":{content},"logprobs":{logprobs},"finish_reason":{finish}}}'

    def role_choices(self) -> list[str]:
        return [_dumps({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}) for c in self.choices]

    def response(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": None,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.content,
                                                           "refusal": None},
                             "logprobs": {"content": c.logprobs} if self.logprobs else None,
                             "finish_reason": c.finish_reason} for c in self.choices],
                "usage": self.usage()}

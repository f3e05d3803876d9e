"""Streamed chunks are built from a per-completion prefix and an encoded choice (no json.dumps of the
whole chunk per token): the bytes must equal json.dumps of the chunk object the SDK parses."""

from __future__ import annotations

import json

import pytest

from services.gateway.completion import Completion, Delta
from services.gateway.safety.output_guard import OutputGuard


def reference(completion: Completion, choices: list[dict], include_usage: bool, usage: dict | None = None) -> bytes:
    body = {"id": completion.id, "object": "chat.completion.chunk", "created": completion.created,
            "model": completion.model, "system_fingerprint": None, "choices": choices}
    if include_usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def choice(delta: Delta) -> dict:
    body = {"index": delta.index, "delta": {"content": delta.text} if delta.text else {}, "logprobs": None,
            "finish_reason": delta.finish_reason}
    if delta.logprobs is not None:
        body["logprobs"] = {"content": delta.logprobs}
    return body


def completion(n: int = 1, model: str = "m\"odel-ü") -> Completion:
    return Completion(model, n, [OutputGuard([]) for _ in range(n)], logprobs=False, prompt_tokens_estimate=3)


DELTAS = [
    Delta(0, "Hello", None, None),
    Delta(0, ' "quoted" \\ back\nslash\ttab \x00\x1f ctl', None, None),
    Delta(0, "ünïcödé 東京 🌊 \u2028\u2029", None, None),
    Delta(3, "", None, "stop"),
    Delta(1, "tail", None, "length"),
    Delta(0, "", None, "content_filter"),
    Delta(0, "x", [{"token": "x", "logprob": -0.25, "bytes": [120],
                    "top_logprobs": [{"token": "y", "logprob": -1.5, "bytes": [121]}]}], None),
    Delta(0, "", [], "stop"),
]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("delta", DELTAS)
def test_delta_chunk_bytes_equal_the_reference(delta, include_usage):
    c = completion()
    assert c.chunk([Completion.chunk_choice(delta)], include_usage) == reference(c, [choice(delta)], include_usage)


@pytest.mark.parametrize("include_usage", [False, True])
def test_role_and_usage_chunks_equal_the_reference(include_usage):
    c = completion(n=3)
    roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for i in range(3)]
    assert c.chunk(c.role_choices(), include_usage) == reference(c, roles, include_usage)
    assert c.chunk([], True, c.usage()) == reference(c, [], True, c.usage())

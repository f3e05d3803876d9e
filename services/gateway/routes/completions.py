"""POST /v1/completions (the legacy text completions API), whole and streamed, through the pipeline.

One prompt per request: a string, a list of one string, a list of token ids or a list of one such
list (a batch of several prompts is refused, naming `prompt`). echo prepends a text prompt;
logprobs N gives the legacy logprobs object (tokens, token_logprobs, top_logprobs, text_offset).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.gateway.chat_request import SAMPLING_FIELDS, SamplingRequest, boolean, check_fields, integer, parse_model, \
    parse_sampling
from services.gateway.completion import Completion, Delta, dumps
from services.gateway.errors import invalid
from services.gateway.pipeline import Generation, Pipeline
from services.gateway.routes import read_json
from services.gateway.sse import DONE
from services.gateway.structured import OutputFormat, check_logit_bias, parse_structured_outputs

DEFAULT_MAX_TOKENS = 16   # OpenAI's default for this API
FIELDS = SAMPLING_FIELDS | {"prompt", "max_tokens", "logprobs", "echo", "best_of", "suffix", "structured_outputs"}
IGNORED = {"user", "metadata", "service_tier", "safety_identifier"}


@dataclass
class CompletionRequest(SamplingRequest):
    prompt: str | None = None
    token_ids: list[int] | None = None
    echo: bool = False
    output: OutputFormat = field(default_factory=OutputFormat)


def _prompt(value: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]                           # a batch of one
    if isinstance(value, str):
        return value, None
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in value):
        return None, value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise invalid("one prompt per request: send the prompts of a batch as separate requests", "prompt",
                      "unsupported_value")
    raise invalid("prompt must be a string, a list of token ids, or a list of one of these", "prompt",
                  "invalid_type" if value is not None else "missing_required_parameter")


def parse_completion_request(body: Any) -> CompletionRequest:
    check_fields(body, FIELDS, IGNORED, set())
    req = CompletionRequest(model=parse_model(body), max_tokens=DEFAULT_MAX_TOKENS)   # before min_tokens' check
    req.prompt, req.token_ids = _prompt(body.get("prompt"))
    parse_sampling(body, req, ("max_tokens",))
    top = integer(body, "logprobs", 0, 5)
    if top is not None:
        req.logprobs, req.top_logprobs = True, top
    req.echo = boolean(body, "echo")
    if req.echo and req.prompt is None:
        raise invalid("echo needs a text prompt (token-id prompts are not detokenized)", "echo", "unsupported_value")
    if req.echo and req.logprobs:
        raise invalid("echo with logprobs (prompt logprobs) is not supported", "echo", "unsupported_value")
    if body.get("suffix"):
        raise invalid("suffix (insertion) is not supported", "suffix", "unsupported_parameter")
    req.output = parse_structured_outputs(body.get("structured_outputs"))
    best_of = integer(body, "best_of", 1, 1 << 31)
    if best_of is not None and best_of != req.n:
        raise invalid("best_of other than n is not supported", "best_of", "unsupported_value")
    return req


def legacy_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """Chat-style logprob entries as the completions API's columns; offsets count from `offset`."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


class CompletionsWire:
    """text_completion objects over the Completion."""
    done = DONE

    def __init__(self, req: CompletionRequest, completion: Completion):
        self.req = req
        self.completion = completion
        self.echo = req.prompt if req.echo else ""
        self.offsets = [len(self.echo)] * len(completion.choices)
        head = dumps({"id": completion.id, "object": "text_completion", "created": completion.created,
                      "model": completion.model, "system_fingerprint": None})
        self._head = "data: " + head[:-1] + ',"choices":['

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        tail = "]" + (',"usage":' + dumps(usage) if self.req.include_usage else "") + "}\n\n"
        return (self._head + ",".join(dumps(c) for c in choices) + tail).encode()

    def opening(self) -> list[bytes]:
        if not self.echo:
            return []
        return [self._chunk([{"index": c.index, "text": self.echo, "logprobs": None, "finish_reason": None}
                             for c in self.completion.choices])]

    def delta(self, delta: Delta) -> list[bytes]:
        logprobs = None
        if delta.logprobs is not None:
            logprobs = legacy_logprobs(delta.logprobs, self.offsets[delta.index])
        self.offsets[delta.index] += len(delta.text)
        return [self._chunk([{"index": delta.index, "text": delta.text, "logprobs": logprobs,
                              "finish_reason": delta.finish_reason}])]

    def closing(self) -> list[bytes]:
        return [self._chunk([], self.completion.usage())] if self.req.include_usage else []

    def body(self) -> dict[str, Any]:
        c = self.completion
        return {"id": c.id, "object": "text_completion", "created": c.created, "model": c.model,
                "system_fingerprint": None,
                "choices": [{"index": ch.index, "text": self.echo + ch.content,
                             "logprobs": legacy_logprobs(ch.logprobs, len(self.echo)) if self.req.logprobs else None,
                             "finish_reason": ch.finish_reason} for ch in c.choices],
                "usage": c.usage()}


async def completions(request: web.Request) -> web.StreamResponse:
    pipeline = await Pipeline.open(request)
    req = parse_completion_request(await read_json(request))
    info = await pipeline.model(req.model, req.max_tokens, "max_tokens")
    check_logit_bias(req.logit_bias, info.vocab_size)
    if req.token_ids and info.vocab_size and max(req.token_ids) >= info.vocab_size:
        raise invalid(f"prompt token {max(req.token_ids)} is outside the vocabulary (0..{info.vocab_size - 1})",
                      "prompt", "invalid_value")
    gen = Generation(model=req.model, sampling=req.sampling(), text=req.prompt, token_ids=req.token_ids,
                     constraint=req.output.constraint, constraint_param=req.output.param, stream=req.stream, max_tokens=req.max_tokens, logprobs=req.logprobs,
                     moderated=[req.prompt] if req.prompt is not None else [], affinity_key=req.prompt_cache_key,
                     temperature=req.temperature, id_prefix="cmpl-", operation="text_completion")
    return await pipeline.run(gen, lambda completion: CompletionsWire(req, completion))


def register(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)

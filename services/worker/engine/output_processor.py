"""Turns sampled tokens into what a caller sees: text deltas, logprobs and finish reasons.

Per request it detokenizes incrementally and checks, token by token, EOS and stop tokens
(not before min_tokens), max_tokens, and stop strings. A stop string is matched in the text,
across token boundaries, so text that could still become one is held back (at most the
longest stop string minus one character) and a matched stop string is never emitted.
A constrained request's matcher consumes each accepted token; the request stops as soon as its
grammar is complete (nothing but EOS could follow).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.worker.engine.model_runner import StepResult
from services.worker.engine.request import Request, RequestStatus
from services.worker.model.detokenizer import IncrementalDetokenizer
from services.worker.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    request_id: str                     # the caller's id (shared by the n choices)
    index: int                          # choice index
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None    # stop | length | abort, on the choice's last output
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    queue_time_s: float = 0.0          # arrival to first schedule

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutputState:
    def __init__(self, request: Request, tokenizer: Tokenizer) -> None:
        self.request = request
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
        self.text = ""
        self.num_emitted_chars = 0
        self.hold_back = max((len(s) for s in request.params.stop), default=1) - 1

    def process(self, result: StepResult) -> RequestOutput:
        r = self.request
        new_tokens: list[int] = []
        for token in result.token_ids:
            r.append_output(token)
            new_tokens.append(token)
            # Both run: the matcher consumes every token, and a complete grammar is a stop even at max_tokens.
            grammar, stop = self._check_grammar(token), self._check_token_stop(token)
            status = grammar or stop
            if status is not None:
                r.status = status
                break
        self.text += self.detokenizer.push(new_tokens)
        if r.finished:
            self.text += self.detokenizer.finish()   # bytes of a character cut off by the stop
        end = len(self.text) if r.finished else max(self.num_emitted_chars, len(self.text) - self.hold_back)
        match = self._find_stop_string()
        if match is not None:
            r.status, end = RequestStatus.FINISHED_STOPPED, match
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        logprobs = None
        if result.logprobs is not None:
            tops = result.top_logprobs or [[] for _ in result.logprobs]
            logprobs = [TokenLogprob(t, lp, top) for t, lp, top in zip(new_tokens, result.logprobs, tops)]
        return self._output(new_tokens, delta, logprobs)

    def abort(self) -> RequestOutput:
        self.request.status = RequestStatus.FINISHED_ABORTED
        return self._output([], "", None)

    def _check_grammar(self, token: int) -> RequestStatus | None:
        matcher = self.request.matcher
        if matcher is None:
            return None
        if not matcher.accept(token):   # the masks make this impossible: a bug, not the caller's
            log.error("request %s: sampled token %d outside its grammar: %s", self.request.request_id,
                      token, matcher.error)
            return RequestStatus.FINISHED_ABORTED
        return RequestStatus.FINISHED_STOPPED if matcher.is_finished else None

    def _check_token_stop(self, token: int) -> RequestStatus | None:
        r, p = self.request, self.request.params
        if r.num_output_tokens >= p.min_tokens:
            if (token in r.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                r.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if r.num_output_tokens >= r.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _find_stop_string(self) -> int | None:
        """Index in self.text where the earliest stop string begins, searching only new text."""
        stops = self.request.params.stop
        if not stops:
            return None
        start = max(0, self.num_emitted_chars - self.hold_back)
        found = [(i, s) for s in stops if (i := self.text.find(s, start)) >= 0]
        if not found:
            return None
        index, stop = min(found)
        self.request.stop_reason = stop
        return max(index, self.num_emitted_chars)

    def _output(self, tokens: list[int], delta: str, logprobs) -> RequestOutput:
        r = self.request
        return RequestOutput(
            request_id=r.parent_id or r.request_id, index=r.index, token_ids=tokens, text=delta,
            logprobs=logprobs, finish_reason=r.status.value if r.finished else None,
            num_prompt_tokens=r.num_prompt_tokens, num_cached_tokens=max(0, r.num_cached_tokens),
            num_output_tokens=r.num_output_tokens, spec_proposed=r.spec_proposed,
            spec_accepted=r.spec_accepted,
            queue_time_s=(r.first_scheduled_time or r.arrival_time) - r.arrival_time)

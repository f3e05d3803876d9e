"""Turns sampled tokens into what a caller sees: text deltas, logprobs and finish reasons.

Per request it detokenizes incrementally and finds stop strings; it changes no request state
(the scheduler has already applied the step's tokens and token stops: stop_checks.py). A stop
string is matched in the text, across token boundaries, so text that could still become one is
held back (at most the longest stop string minus one character) and a matched stop string is
never emitted; the engine then has the scheduler finish the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.engine.model_runner import StepResult
from services.worker.engine.request import Request, RequestStatus
from services.worker.model.detokenizer import IncrementalDetokenizer
from services.worker.model.tokenizer import Tokenizer


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

    def process(self, new_tokens: list[int], result: StepResult) -> tuple[RequestOutput, str | None]:
        """The output of the tokens the request just took (new_tokens, from result), and the stop
        string the text now holds, if any (the request must then finish)."""
        r = self.request
        self.text += self.detokenizer.push(new_tokens)
        if r.finished:
            self.text += self.detokenizer.finish()   # bytes of a character cut off by the stop
        end = len(self.text) if r.finished else max(self.num_emitted_chars, len(self.text) - self.hold_back)
        stop, match = self._find_stop_string()
        if stop is not None:
            end = match
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        logprobs = None
        if result.logprobs is not None:
            tops = result.top_logprobs or [[] for _ in result.logprobs]
            logprobs = [TokenLogprob(t, lp, top) for t, lp, top in zip(new_tokens, result.logprobs, tops)]
        finish = RequestStatus.FINISHED_STOPPED if stop is not None else r.status
        return self._output(new_tokens, delta, logprobs, finish), stop

    def abort(self) -> RequestOutput:
        """The last output of a request the scheduler has aborted."""
        return self._output([], "", None, RequestStatus.FINISHED_ABORTED)

    def _find_stop_string(self) -> tuple[str | None, int]:
        """The earliest stop string in the new text and the index in self.text where it begins."""
        stops = self.request.params.stop
        if not stops:
            return None, 0
        start = max(0, self.num_emitted_chars - self.hold_back)
        found = [(i, s) for s in stops if (i := self.text.find(s, start)) >= 0]
        if not found:
            return None, 0
        index, stop = min(found)
        return stop, max(index, self.num_emitted_chars)

    def _output(self, tokens: list[int], delta: str, logprobs, status: RequestStatus) -> RequestOutput:
        r = self.request
        return RequestOutput(
            request_id=r.parent_id or r.request_id, index=r.index, token_ids=tokens, text=delta,
            logprobs=logprobs, finish_reason=status.value if status.finished else None,
            num_prompt_tokens=r.num_prompt_tokens, num_cached_tokens=max(0, r.num_cached_tokens),
            num_output_tokens=r.num_output_tokens, spec_proposed=r.spec_proposed,
            spec_accepted=r.spec_accepted,
            queue_time_s=(r.first_scheduled_time or r.arrival_time) - r.arrival_time)

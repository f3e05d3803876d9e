"""The front end's half of a request: turns the core's per-choice token outputs into what a caller
sees (text deltas, logprobs, finish reasons), and finds stop strings.

Per choice it detokenizes incrementally. A stop string is matched in the text, across token
boundaries, so text that could still become one is held back (at most the longest stop string
minus one character) and a matched stop string is never emitted. A choice that matched one is
finished here at once; the caller must then have the core stop it (the ids `process` returns),
and whatever the core still sends for that choice (it may have run further steps meanwhile, when
it lives in another process) is dropped: no token after a stop string reaches the caller.

Plain data in (core_protocol.EngineCoreOutput), plain data out: no torch, no request state.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.engine.core_protocol import EngineCoreOutput, sibling_ids
from services.worker.engine.sampling_params import SamplingParams
from services.worker.model.detokenizer import IncrementalDetokenizer
from services.worker.model.tokenizer import Tokenizer

ABORT = "abort"
STOP = "stop"


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
    """One choice's text so far."""

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer) -> None:
        self.request_id, self.index = request_id, index
        self.stops = params.stop
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.text = ""
        self.num_emitted_chars = 0
        self.hold_back = max((len(s) for s in self.stops), default=1) - 1
        self.finished = False
        self.last: EngineCoreOutput | None = None   # the latest output seen: its counters

    def process(self, out: EngineCoreOutput) -> tuple[RequestOutput, bool]:
        """The caller's output for the tokens the choice just took, and whether its text now holds
        a stop string (the choice is then finished here, and the core must stop it)."""
        self.last = out
        finished = out.finish_reason is not None
        self.text += self.detokenizer.push(out.token_ids)
        if finished:
            self.text += self.detokenizer.finish()   # bytes of a character cut off by the stop
        end = len(self.text) if finished else max(self.num_emitted_chars, len(self.text) - self.hold_back)
        match = self._find_stop_string()
        if match is not None:
            end = match
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        logprobs = None
        if out.logprobs is not None:
            tops = out.top_logprobs or [[] for _ in out.logprobs]
            logprobs = [TokenLogprob(t, lp, [tuple(x) for x in top])
                        for t, lp, top in zip(out.token_ids, out.logprobs, tops)]
        reason = STOP if match is not None else out.finish_reason
        return self._output(out.token_ids, delta, logprobs, reason), match is not None

    def abort(self) -> RequestOutput:
        """The last output of a choice that was aborted (held-back text is dropped)."""
        return self._output([], "", None, ABORT)

    def _find_stop_string(self) -> int | None:
        """Where in self.text the earliest stop string in the new text begins, if any."""
        if not self.stops:
            return None
        start = max(0, self.num_emitted_chars - self.hold_back)
        found = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        return max(min(found), self.num_emitted_chars) if found else None

    def _output(self, tokens: list[int], delta: str, logprobs, reason: str | None) -> RequestOutput:
        self.finished = reason is not None
        o = self.last
        if o is None:   # aborted before the core sent anything
            return RequestOutput(self.request_id, self.index, tokens, delta, logprobs, reason)
        return RequestOutput(
            request_id=self.request_id, index=self.index, token_ids=tokens, text=delta, logprobs=logprobs,
            finish_reason=reason, num_prompt_tokens=o.num_prompt_tokens, num_cached_tokens=o.num_cached_tokens,
            num_output_tokens=o.num_output_tokens, spec_proposed=o.spec_proposed, spec_accepted=o.spec_accepted,
            queue_time_s=o.queue_time_s)


class OutputProcessor:
    """The text state of every open request's choices; forgets a request once all have finished."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, RequestOutputState] = {}   # choice id -> its state
        self._choices: dict[str, list[str]] = {}           # caller id -> its choice ids

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    output_id: str | None = None) -> None:
        """request_id: as the core knows it; output_id: the id its outputs carry (default the same)."""
        ids = sibling_ids(request_id, params.n)
        for i, choice_id in enumerate(ids):
            self._states[choice_id] = RequestOutputState(output_id or request_id, i, prompt_token_ids, params,
                                                         self.tokenizer)
        self._choices[request_id] = ids

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """-> the caller's outputs, and the ids of choices that matched a stop string while the core
        still runs them (the caller stops them in the core)."""
        results, to_stop = [], []
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None or state.finished:
                continue   # finished here already (a stop string, an abort): nothing more goes out
            if out.finish_reason == ABORT and not out.token_ids:
                state.last = out
                result = state.abort()
            else:
                result, stopped = state.process(out)
                if stopped and out.finish_reason is None:
                    to_stop.append(out.request_id)
            results.append(result)
            if result.finished:
                self._forget_if_done(out.parent_id)
        return results, to_stop

    def abort(self, request_id: str) -> list[RequestOutput]:
        """The last outputs of a request aborted by its caller (one per unfinished choice); forgets it."""
        states = [self._states.pop(i) for i in self._choices.pop(request_id, []) if i in self._states]
        return [s.abort() for s in states if not s.finished]

    def has_request(self, request_id: str) -> bool:
        return request_id in self._choices

    def _forget_if_done(self, request_id: str) -> None:
        ids = self._choices.get(request_id, [])
        if all(self._states[i].finished for i in ids):
            self._choices.pop(request_id, None)
            for i in ids:
                self._states.pop(i, None)

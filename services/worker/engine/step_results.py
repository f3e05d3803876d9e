"""What one step gave the requests that sampled in it, as the runner hands it to the scheduler.

Most rows of a step sample one plain token. Those are kept in column form: maps from request id
to token (and logprobs), built in C from the sampled ids and the sampled values, so a step makes
no Python object per request (at 256 rows, 1 us a row is 0.26 ms a step). A row that verified
drafts (speculation) has a StepResult of its own. A request is in at most one of the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(slots=True)
class StepResult:
    token_ids: list[int]                                   # 1 token, or the accepted drafts + 1
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_rejected: int = 0                                  # draft tokens whose slots are void
    draft_lag: int = 0                                     # see Request.draft_lag


class StepResults:
    __slots__ = ("tokens", "logprobs", "top_logprobs", "verified", "with_logprobs")

    def __init__(self, verified: dict[str, StepResult] | None = None, ids: Sequence[str] = (),
                 token_ids: Sequence[int] = (), logprobs: Sequence[float] | None = None,
                 top_logprobs: Sequence[list[tuple[int, float]]] | None = None) -> None:
        """verified: the verifying rows' results; ids, token_ids (and logprobs, top_logprobs, when
        the batch computed them): the plain rows', in the same order."""
        self.verified = verified if verified is not None else {}
        self.tokens: dict[str, int] = dict(zip(ids, token_ids))
        self.logprobs = None if logprobs is None else dict(zip(ids, logprobs))
        self.top_logprobs = None if top_logprobs is None else dict(zip(ids, top_logprobs))
        # A batch computes logprobs for every plain row once one asks: the caller checks its own ask.
        self.with_logprobs = logprobs is not None or any(r.logprobs is not None for r in self.verified.values())

    def get(self, request_id: str) -> StepResult | None:
        """One request's result (None: it sampled nothing this step)."""
        token = self.tokens.get(request_id)
        if token is None:
            return self.verified.get(request_id)
        return StepResult([token], *self._plain_logprobs(request_id))

    def __getitem__(self, request_id: str) -> StepResult:
        result = self.get(request_id)
        if result is None:
            raise KeyError(request_id)
        return result

    def logprobs_of(self, request_id: str, n: int) -> tuple[list[float] | None, list | None]:
        """The logprobs (and top logprobs) of a request's first n tokens this step, where computed."""
        if request_id in self.tokens:
            return self._plain_logprobs(request_id)
        result = self.verified.get(request_id)
        if result is None or result.logprobs is None:
            return None, None
        tops = result.top_logprobs
        return result.logprobs[:n], tops[:n] if tops is not None else None

    def _plain_logprobs(self, request_id: str) -> tuple[list[float] | None, list | None]:
        if self.logprobs is None:
            return None, None
        tops = self.top_logprobs
        return [self.logprobs[request_id]], [tops[request_id]] if tops is not None else None

"""A request's state inside the engine: its tokens, progress through them and its lifecycle.

Invariant: all_token_ids = prompt + output; num_computed_tokens of them have keys and values in
the cache once the steps scheduled so far have run (the scheduler advances it when it schedules a
step). A step schedules tokens num_computed_tokens..num_tokens-1 (plus any speculative draft
tokens); when the step reaches the last token it samples a new one. With overlap a step is
scheduled while the one before it runs: the tokens that one will sample are counted in
num_output_placeholders until their ids arrive, and the next step computes them already (the
runner reads them on the device).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.worker.engine.fair_queue import FairShare
from services.worker.engine.sampling_params import SamplingParams
from services.worker.spec.adaptive import AdaptiveDraftLength

if TYPE_CHECKING:
    from services.worker.engine.structured.matcher import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"       # back in the waiting queue, its cache freed, to be recomputed
    FINISHED_STOPPED = "stop"     # EOS, stop token or stop string
    FINISHED_LENGTH = "length"    # max_tokens or the context length
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


# A plain tuple: membership is an identity test (reading members off the enum class is slow,
# and Request.finished runs per request per step).
_FINISHED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                         # resolved: never runs past the context length
    eos_token_ids: list[int]
    cache_salt: str = ""
    index: int = 0                          # choice index among the n siblings
    parent_id: str = ""                     # the caller's request id (siblings share it)
    arrival_time: float = field(default_factory=time.monotonic)
    share: FairShare = field(default_factory=FairShare)   # tenant, weight, priority in the waiting queue

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1             # prompt tokens found in the prefix cache at first schedule
    num_output_placeholders: int = 0        # sampled by a step in flight, ids not known yet
    # Speculative decoding: the next step verifies num_spec_tokens drafts. The n-gram proposer's are
    # known before scheduling (spec_token_ids); a draft model makes them inside the step.
    num_spec_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    # Computed tokens at the end that a draft model's KV cache still lacks: 1 after the target
    # accepted all k drafts (the draft model never ran on its k-th), else 0.
    draft_lag: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None    # the stop string or token that finished it
    generator: torch.Generator | None = None   # seeded requests: on the runner's device (LLMEngine sets it)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    spec_proposed: int = 0
    spec_accepted: int = 0
    draft_length: AdaptiveDraftLength = field(default_factory=AdaptiveDraftLength)
    # A constrained request's grammar state: it has consumed exactly output_token_ids.
    matcher: GrammarMatcher | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def finished(self) -> bool:
        return self.status in _FINISHED

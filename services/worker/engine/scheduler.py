"""Continuous batching under a token budget (vLLM v1 style), with preemption by recompute.

Every step re-forms the batch. Running requests are served first, in admission order: each
is granted the tokens it still lacks (1 for a decode, 1 + k while verifying k speculative
tokens, the rest of its prompt, chunked, while prefilling). Waiting requests are admitted
after them while the budget, the free blocks and the running cap allow, tenants in weighted
fair order by tokens served (fair_queue.py; one tenant: first come first served); the head of
the queue is never skipped, so nobody starves. When a running request
cannot get a block, the most recently admitted request is preempted: its blocks are freed
and it goes back to the head of the queue, to be recomputed (its finished prefix blocks stay
findable in the prefix cache, so recompute is often cheap).

The scheduler is the one owner of request state after a step: update_from_output applies the
runner's results (computed tokens, accepted drafts, the sampled tokens and the stops they
make), and finish takes a request out (finished, stopped on a string, aborted) and frees its
blocks. The engine and the output processor only read requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.worker.engine.fair_queue import FairQueue
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.stop_checks import check_stop

if TYPE_CHECKING:
    from services.worker.engine.model_runner import StepResult


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int          # tokens computed this step, from request.num_computed_tokens
    num_spec_tokens: int         # the last num_spec_tokens of them are unverified drafts
    block_ids: list[int]
    start_position: int = 0      # request.num_computed_tokens when scheduled
    samples: bool = False        # the step reaches the last known token, so a new one is sampled

    def __post_init__(self) -> None:
        r = self.request
        self.start_position = r.num_computed_tokens
        self.samples = r.num_computed_tokens + self.num_known_tokens >= r.num_tokens

    @property
    def num_known_tokens(self) -> int:
        """The new tokens that are already part of the request (all but the drafts)."""
        return self.num_new_tokens - self.num_spec_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = FairQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self.kv.begin_step()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_spec = request.num_spec_tokens if request.num_computed_tokens == request.num_tokens - 1 else 0
            num_new = min(request.num_tokens + num_spec - request.num_computed_tokens, budget)
            num_spec = max(0, min(num_spec, num_new - 1))
            while not self.kv.allocate(request, num_new, num_tokens_to_cache=request.num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new, num_spec, self.kv.block_ids(request.request_id)))
                budget -= num_new
                i += 1
                continue
            break
        if out.preempted:
            self.waiting.charge(out.scheduled)
            return out   # the pool is full: admitting now would only preempt again
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            cached, num_cached = self.kv.find_cached_prefix(request)
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate(request, num_new, cached):
                break
            self.waiting.pop()
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new, 0, self.kv.block_ids(request.request_id)))
            budget -= num_new
        self.waiting.charge(out.scheduled)
        return out

    def update_from_output(self, out: SchedulerOutput, results: dict[str, StepResult],
                           now: float) -> list[tuple[Request, list[int]]]:
        """Apply the step `out` ran: its tokens are computed, less the rejected drafts; each sampled
        request takes its accepted tokens up to the first that stops it, and a finished one leaves.
        -> (request, the tokens it took) per request that sampled."""
        updates = []
        for item in out.scheduled:
            r = item.request
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
            r.num_computed_tokens += item.num_new_tokens
            result = results.get(r.request_id)
            if result is None:
                continue                       # a prefill chunk: nothing sampled yet
            r.num_computed_tokens -= result.num_rejected
            r.draft_lag = result.draft_lag
            if item.num_spec_tokens:
                accepted = len(result.token_ids) - 1
                r.spec_proposed += item.num_spec_tokens
                r.spec_accepted += accepted
                r.draft_length.record(item.num_spec_tokens, accepted)
            r.spec_token_ids, r.num_spec_tokens = [], 0
            if r.first_token_time is None:
                r.first_token_time = now
            taken = []
            for token in result.token_ids:
                r.append_output(token)
                taken.append(token)
                status = check_stop(r, token)
                if status is not None:
                    self.finish(r, status)
                    break
            updates.append((r, taken))
        return updates

    def set_draft(self, request: Request, num_spec_tokens: int, token_ids: list[int]) -> None:
        """The next step verifies num_spec_tokens drafts (token_ids: the n-gram's, known now)."""
        request.num_spec_tokens, request.spec_token_ids = num_spec_tokens, token_ids

    def finish(self, request: Request, status: RequestStatus, stop_reason: str | None = None) -> None:
        """Remove a request from the queues and return its blocks (finish or abort). A request that
        already finished on a token and also matched a stop string only takes the string's status."""
        was_finished = request.finished
        request.status = status
        if stop_reason is not None:
            request.stop_reason = stop_reason
        if was_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.waiting.finished(request)
        self.kv.free(request)

    def roll_back(self, out: SchedulerOutput, blamed: set[str]) -> None:
        """The step `out` failed before any state moved: the blocks it registered in the prefix cache
        hold no valid KV, so they are taken back; the requests it cannot blame go back to the head
        of the queue to be recomputed as after a preemption (one admitted in the step may share a
        block a blamed request never wrote). The caller aborts the blamed ones."""
        self.kv.unregister_step()
        for item in reversed(out.scheduled):   # newest first, so the queue keeps admission order
            if item.request.request_id not in blamed:
                self.running.remove(item.request)
                self._preempt(item.request, counted=False)

    def _preempt(self, request: Request, counted: bool = True) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_spec_tokens = 0
        request.draft_lag = 0          # a draft model recomputes from scratch too
        if counted:
            request.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.requeue(request)

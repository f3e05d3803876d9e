"""Continuous batching under a token budget (vLLM v1 style), with preemption by recompute.

Every step re-forms the batch. Running requests are served first, in admission order: each
is granted the tokens it still lacks (1 for a decode, 1 + k while verifying k speculative
tokens, the rest of its prompt, chunked, while prefilling). Waiting requests are admitted
after them while the budget, the free blocks and the running cap allow, tenants in weighted
fair order by tokens served (fair_queue.py; one tenant: first come first served); the head of
the queue is never skipped, so nobody starves. Prompt work (running requests' chunks, admissions)
may be bounded further per step (schedule's prompt_budget, from the engine's max_step_time_s), and
a running request's next chunk leaves room for the head of the queue when that belongs to another
tenant ranked no later, and a newcomer of a tenant with nothing running has a step of its own,
never two such steps in a row (_head_claim). When a running request cannot get a block, the most
recently admitted request is preempted: its blocks are freed and it goes back to the head of the
queue, to be recomputed (its finished prefix blocks stay findable in the prefix cache, so
recompute is often cheap).

The scheduler is the one owner of request state: schedule advances each scheduled request's
computed tokens and counts the token it will sample as a placeholder; update_from_output applies
the runner's results (rejected drafts, the sampled tokens and the stops they make), and finish
takes a request out (finished, stopped on a string, aborted) and frees its blocks. The engine
and the output processor only read requests.

Overlap (async scheduling): the next step may be scheduled before the results of the one in
flight are applied. It then counts that step's placeholders as tokens (a decode computes the
token the step in flight samples), never schedules a request past its max_tokens, and registers
in the prefix cache only blocks of known tokens. A request that finishes when the results come
(a stop token, one step late) may already be in the next step: what that step samples for it is
dropped. A request preempted while in flight takes its token when the results come, in the queue.

Each step's plan (SchedulerOutput) is all the runner reads: a request the runner does not hold
comes with its tokens, sampling settings and whole block table (NewRequest), the first time it
is scheduled or after a preemption; later steps carry only diffs (the step's token counts, the
block ids appended since the runner last saw the table, the drafts to verify); and the ids that
left (finished, aborted, preempted) since the last plan the runner saw. The runner appends the
tokens it sampled itself: any it sampled past a stop belong to a request that leaves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.worker.engine.fair_queue import FairQueue
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.stop_checks import check_stop

if TYPE_CHECKING:
    from services.worker.engine.step_results import StepResults


# A light tenant has at most this fraction of the busiest tenant's requests in the engine (a user
# chatting beside a flood, not two floods). The engine still counts as serving one for
# LIGHT_GRACE_STEPS steps after it left: its next request, sent as its last answer ends, comes then.
LIGHT_TENANT_FRACTION = 0.25
LIGHT_GRACE_STEPS = 4


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(slots=True)
class NewRequest:
    """What the runner keeps about a request it does not hold yet (first schedule, or after a
    preemption): everything sampling reads, copied, so the runner never reads the live request."""
    token_ids: list[int]               # prompt + output so far
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...]     # () when EOS is not held back (ignore_eos, or a grammar decides)
    constrained: bool                  # sampled under its grammar's masks (StepMasks)

    @classmethod
    def of(cls, request: Request) -> NewRequest:
        free_eos = request.params.ignore_eos or request.matcher is not None
        return cls(list(request.all_token_ids), request.num_prompt_tokens, request.params, request.generator,
                   () if free_eos else tuple(request.eos_token_ids), request.matcher is not None)


_NONE: list[int] = []   # shared, never changed: an empty diff


class ScheduledRequest:
    """One request's part of a step. block_ids is the live table (read it, never change it);
    new_block_ids replace the runner's table from index block_start on (the ids appended since
    the runner last saw it; the whole table for a new request or under a sliding window)."""

    __slots__ = ("request", "request_id", "num_new_tokens", "num_spec_tokens", "block_ids", "start_position",
                 "samples", "new", "new_block_ids", "block_start", "spec_token_ids", "draft_lag")

    def __init__(self, request: Request, num_new_tokens: int, num_spec_tokens: int, block_ids: list[int],
                 new: NewRequest | None = None, block_start: int = 0,
                 spec_token_ids: list[int] | None = None) -> None:
        self.request = request
        self.request_id = request.request_id
        self.num_new_tokens = num_new_tokens      # tokens computed this step, from request.num_computed_tokens
        self.num_spec_tokens = num_spec_tokens    # the last num_spec_tokens of them are unverified drafts
        self.block_ids = block_ids
        self.start_position = start = request.num_computed_tokens
        # The step reaches the last token (a placeholder's too), so a new one is sampled.
        self.samples = (start + num_new_tokens - num_spec_tokens
                        >= len(request.all_token_ids) + request.num_output_placeholders)
        self.new = new
        self.block_start = block_start
        self.new_block_ids = block_ids[block_start:] if block_start < len(block_ids) else _NONE
        # The n-gram's drafts (a draft model makes its own inside the step).
        if spec_token_ids is None:
            spec_token_ids = request.spec_token_ids[:num_spec_tokens] if num_spec_tokens else _NONE
        self.spec_token_ids = spec_token_ids
        self.draft_lag = request.draft_lag   # a draft model's catch-up starts this many tokens earlier

    @property
    def num_known_tokens(self) -> int:
        """The new tokens that are already part of the request (all but the drafts)."""
        return self.num_new_tokens - self.num_spec_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)   # left the runner's batch since its last plan

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
        self._light_steps = 0
        self._own_step_before = False   # the last step was newcomers' own: this one decodes
        # The runner's view: block ids it holds per request it holds, and who left since its last plan.
        self._sent_blocks: dict[str, int] = {}
        self._left: list[str] = []
        # Under a sliding window the manager rewrites released entries: tables are sent whole.
        self._whole_tables = kv.sliding_window is not None

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def serves_a_light_tenant(self) -> bool:
        """A light tenant beside a busier one has had requests in the engine within the last
        LIGHT_GRACE_STEPS calls (one per step)."""
        counts = self.waiting.active_counts()
        if len(counts) > 1 and min(counts) <= LIGHT_TENANT_FRACTION * max(counts):
            self._light_steps = LIGHT_GRACE_STEPS
        elif self._light_steps:
            self._light_steps -= 1
        return self._light_steps > 0

    def num_decoding(self) -> int:
        """Running requests past their prompt: the streams a step's prompt work delays."""
        return sum(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running)

    def schedule(self, prompt_budget: int | None = None) -> SchedulerOutput:
        """prompt_budget: the most prompt tokens (chunks, admissions, recomputes) the step takes
        beside its decodes (None: only max_num_batched_tokens bounds them)."""
        self.kv.begin_step()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        prompt = budget if prompt_budget is None else min(budget, prompt_budget)
        claim = None   # the head of the queue's (_head_claim), looked up at the first chunk: most steps have none
        yielded = False   # a chunk was held back for a newcomer of a tenant with nothing running
        counter = self.waiting.counter
        running, scheduled, allocate = self.running, out.scheduled, self.kv.allocate
        own_step = False   # newcomers of tenants with nothing running, alone (_head_claim)
        if running and not self._own_step_before and self.waiting.head_tenant_idle():
            claim = self._head_claim(prompt)
            own_step = claim[0] > 0 and claim[3]
            if own_step:
                running = ()
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_known, placeholders = len(request.all_token_ids), request.num_output_placeholders
            if placeholders and len(request.output_token_ids) + placeholders >= request.max_tokens:
                i += 1                         # the step in flight gives its last token
                continue
            num_tokens, num_computed = num_known + placeholders, request.num_computed_tokens
            num_spec = request.num_spec_tokens if num_computed == num_tokens - 1 else 0
            num_new = num_tokens + num_spec - num_computed
            chunk = num_computed < num_tokens - 1
            if chunk:                          # prompt work: within the prompt budget, in fair order
                if claim is None:
                    claim = self._head_claim(prompt)
                head_need, head_tenant, head_rank, head_alone = claim
                cap = prompt
                tenant = request.share.tenant
                if head_need and tenant != head_tenant and counter(tenant) >= head_rank:
                    cap = 0 if head_alone else cap - head_need
                    yielded = yielded or head_alone
                if cap <= 0:
                    i += 1
                    continue
                if num_new > cap:
                    num_new = cap
            if num_new > budget:
                num_new = budget
            if num_spec:
                num_spec = max(0, min(num_spec, num_new - 1))
            while not allocate(request, num_new, num_tokens_to_cache=num_known):
                victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new, num_spec))
                budget -= num_new
                if chunk:
                    prompt -= num_new
                i += 1
                continue
            break
        if not out.preempted:   # else the pool is full: admitting now would only preempt again
            if own_step:
                self._admit(out, min(budget, prompt), idle_tenants_only=True)
            else:
                self._admit(out, min(budget, claim[0] if yielded else prompt))
        self._own_step_before = own_step
        self.waiting.charge(scheduled)
        if scheduled:   # a plan with nothing scheduled never reaches the runner
            out.finished_ids, self._left = self._left, []
        return out

    def _head_claim(self, prompt: int) -> tuple[int, str, float, bool]:
        """What the head of the queue would take of the step's prompt budget, its tenant, the
        tenant's counter and whether the tenant has nothing running, when it can be admitted now;
        (0, "", inf, False) otherwise. A running request of another tenant not ranked before it (a
        counter as large: a tenant that turns active takes the smallest active counter) leaves it
        that much of its next chunk: under one tenant's flood, another's newcomer is prefilled in
        the next step, not behind the flood's prompts. A newcomer of a tenant with nothing running
        (a light user beside a flood) has the next step to itself, its first prompt chunk alone
        (with those of other such tenants queued behind it, within the prompt budget): its first
        token waits for its own prefill, not for the flood's decodes and chunks beside it
        (bench-load's light organization beside a 24-stream flood, 12-06: TTFT p95 5.06x unloaded
        before, 2.72x with this and the fair queue's tie rule; the target is 3x). The decodes lose
        no token for it: they come one step later, as they would have come at the end of a step
        that held its prefill, and cost one more pass over the weights. The step after such a step
        decodes, so newcomers of many organizations at once do not stall the streams. Tenants that
        both run (two floods) share the budget as above, so their throughput is not spent on
        short steps."""
        waiting = self.waiting
        if not waiting or len(self.running) >= self.config.max_num_seqs:
            return 0, "", math.inf, False
        head, rank = waiting.peek(), waiting.head_rank()
        _, num_cached = self.kv.find_cached_prefix(head)
        need = min(head.num_tokens - num_cached, prompt)
        if -(-need // self.kv.block_size) > self.kv.pool.num_free_blocks:
            return 0, "", math.inf, False      # it would not fit: holding the budget back only stalls
        tenant = head.share.tenant
        return need, tenant, rank, all(r.share.tenant != tenant for r in self.running)

    def _admit(self, out: SchedulerOutput, budget: int, idle_tenants_only: bool = False) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if idle_tenants_only and not self.waiting.head_tenant_idle():
                break
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
            out.scheduled.append(self._scheduled(request, num_new, 0))
            budget -= num_new

    def _scheduled(self, request: Request, num_new: int, num_spec: int) -> ScheduledRequest:
        """The request's entry in the plan, the runner's view of its table brought up to date, and
        the request advanced past the step."""
        rid = request.request_id
        block_ids = self.kv.block_ids(rid)
        sent_blocks = self._sent_blocks
        sent = sent_blocks.get(rid)
        num_blocks = len(block_ids)
        if sent is None:
            sent_blocks[rid] = num_blocks
            item = ScheduledRequest(request, num_new, num_spec, block_ids, new=NewRequest.of(request))
        else:
            if sent != num_blocks:
                sent_blocks[rid] = num_blocks
            item = ScheduledRequest(request, num_new, num_spec, block_ids, block_start=0 if self._whole_tables else sent)
        request.num_computed_tokens += num_new
        if item.samples:
            request.num_output_placeholders += 1
        return item

    def update_from_output(self, out: SchedulerOutput, results: StepResults,
                           now: float) -> list[tuple[Request, list[int]]]:
        """Apply the step `out` ran: its rejected drafts are not computed after all; each sampled
        request takes its accepted tokens up to the first that stops it, and a finished one leaves.
        A request that finished while the step ran takes nothing.
        -> (request, the tokens it took) per request that sampled."""
        updates = []
        append = updates.append
        plain, verified = results.tokens, results.verified
        for item in out.scheduled:
            r = item.request
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
            token = plain.get(item.request_id)
            if token is not None:              # most rows: one plain token
                tokens, num_rejected, draft_lag = [token], 0, 0
            else:
                result = verified.get(item.request_id)
                if result is None:
                    continue                   # a prefill chunk: nothing sampled yet
                tokens, num_rejected, draft_lag = result.token_ids, result.num_rejected, result.draft_lag
            r.num_output_placeholders -= 1
            if r.finished:
                continue
            r.draft_lag = draft_lag
            if item.num_spec_tokens:
                r.num_computed_tokens -= num_rejected
                accepted = len(tokens) - 1
                r.spec_proposed += item.num_spec_tokens
                r.spec_accepted += accepted
                r.draft_length.record(item.num_spec_tokens, accepted)
            if r.num_spec_tokens or r.spec_token_ids:
                r.spec_token_ids, r.num_spec_tokens = [], 0
            if r.first_token_time is None:
                r.first_token_time = now
            if len(tokens) == 1:               # most steps: one token, no drafts
                token = tokens[0]
                r.output_token_ids.append(token)
                r.all_token_ids.append(token)
                status = check_stop(r, token)
                if status is not None:
                    self.finish(r, status)
                append((r, tokens))
                continue
            for j, token in enumerate(tokens):
                r.output_token_ids.append(token)
                r.all_token_ids.append(token)
                status = check_stop(r, token)
                if status is not None:
                    self.finish(r, status)
                    tokens = tokens[:j + 1]
                    break
            append((r, tokens))
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
        self._release(request)

    def roll_back(self, out: SchedulerOutput, blamed: set[str]) -> None:
        """The step `out` failed before it ran, so its schedule is undone: the blocks it registered
        in the prefix cache hold no valid KV, so they are taken back, and so are its placeholders;
        the requests it cannot blame go back to the head of the queue to be recomputed as after a
        preemption (one admitted in the step may share a block a blamed request never wrote). The
        caller aborts the blamed ones. The runner may not have taken the plan: the ids that left
        before it go out again with the next (the runner ignores those it no longer holds, and
        takes them before any new request of that plan)."""
        self.kv.unregister_step()
        self._left = out.finished_ids + self._left
        for item in reversed(out.scheduled):   # newest first, so the queue keeps admission order
            if item.samples:
                item.request.num_output_placeholders -= 1
            if item.request.request_id not in blamed:
                self.running.remove(item.request)
                self._preempt(item.request, counted=False)

    def _release(self, request: Request) -> None:
        """Its blocks back to the pool, and out of the runner's batch at the next plan."""
        self.kv.free(request)
        if self._sent_blocks.pop(request.request_id, None) is not None:
            self._left.append(request.request_id)

    def _preempt(self, request: Request, counted: bool = True) -> None:
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0   # a token it has in flight still comes (update_from_output)
        request.spec_token_ids = []
        request.num_spec_tokens = 0
        request.draft_lag = 0          # a draft model recomputes from scratch too
        if counted:
            request.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.requeue(request)

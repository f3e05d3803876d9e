"""The engine core: the one owner of request state. Requests in, one scheduled and executed batch
per step, plain per-choice outputs (token ids, logprobs, finish status) out.

It owns the scheduler, the KV cache manager and block pool, the runner, the grammar compiler and
matchers, the proposer, load stats and fair shares. It never sees text: detokenization and stop
strings belong to the front end (output_processor.py), which asks the core to stop a choice whose
text matched one (abort_requests with FINISHED_STOPPED). Token stops (EOS, stop token ids,
max_tokens, a complete grammar) are found here, by the scheduler (stop_checks.py).

Single-threaded by design: whoever drives it (llm_engine.py in process, core_process.py in its
own process) calls it from one thread. A request with n > 1 becomes n sibling requests over the
same prompt; the prefix cache makes them share the prompt's full blocks.

Speculative decoding: after each step the core picks k for every decoding request (its own or
the worker's default, shortened by the adaptive draft length). The n-gram proposer drafts then,
from token ids; a draft model in the runner drafts inside the next step, into the slots the
scheduler reserves for k tokens.

Overlap (async_scheduling, vLLM v1's async scheduling): the next step is scheduled and submitted
while the device runs the one before, whose results are applied after (the runner feeds its
tokens to the next step on the device). Outputs are the same as without it, one step later. A
request whose next step needs the last token on the host (penalties, min_tokens, a grammar,
speculation) turns it off while it is there: the step in flight is applied first.

Constrained decoding: each constrained request (each of its n choices) holds its own grammar
matcher, from a grammar compiled once per constraint (structured/compiler.py). A step's masks
are computed on a helper thread while its forward pass runs; the matcher advances only over the
tokens the scheduler accepts (stop_checks.py), and n-gram drafts are cut where the grammar refuses them.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from services.worker.engine.block_pool import BlockPool
from services.worker.engine.core_protocol import (EngineCoreOutput, EngineLimits, EngineStats, sibling_ids,
                                                  validate_request)
from services.worker.engine.fair_queue import FairShare
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.load_stats import LoadStats
from services.worker.engine.model_runner import ModelRunner, PendingStep, RequestStepError
from services.worker.engine.penalties import penalised
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from services.worker.engine.step_results import StepResults
from services.worker.engine.structured.compiler import GrammarCompiler
from services.worker.engine.structured.step_masks import StepMasks
from services.worker.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Makes an EngineCoreOutput from its fields in order. Its NamedTuple __new__ is a Python function
# that cost about as much as the rest of an output, which is made per choice per step.
_new_output = tuple.__new__


class InFlight(NamedTuple):
    plan: SchedulerOutput
    pending: PendingStep
    started: float


class EngineCore:
    def __init__(self, limits: EngineLimits, runner: ModelRunner, tokenizer: Tokenizer,
                 vocab_size: int, proposer=None, num_speculative_tokens: int = 0,
                 async_scheduling: bool = False) -> None:
        self.limits = limits
        self.runner = runner
        self.vocab_size = vocab_size
        self.eos_token_ids = list(tokenizer.eos_token_ids)
        self.pool = BlockPool(limits.num_blocks)
        self.kv = KVCacheManager(self.pool, limits.block_size, limits.enable_prefix_caching,
                                 limits.sliding_window)
        self.scheduler = Scheduler(SchedulerConfig(limits.max_num_seqs, limits.max_num_batched_tokens), self.kv)
        self.proposer = proposer   # n-gram: drafts from token ids, before scheduling
        self.drafts_in_step = runner.drafter is not None
        self.num_speculative_tokens = num_speculative_tokens
        self._requests: dict[str, list[Request]] = {}   # caller id -> its n siblings
        self._siblings: dict[str, Request] = {}         # sibling id -> request
        self.grammars = GrammarCompiler(tokenizer, vocab_size)
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self.load_stats = LoadStats()
        self.async_scheduling = async_scheduling
        self._in_flight: InFlight | None = None   # submitted, its results not applied yet
        self._num_sync_choices = 0                 # unfinished choices that need every token on the host

    # -- admission ---------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request before it is queued; returns its resolved max_tokens."""
        return validate_request(self.limits, self.vocab_size, prompt_token_ids, params, self.grammars.compile)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str = "", share: FairShare = FairShare()) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.validate(prompt_token_ids, params)
        siblings = []
        for i, sibling_id in enumerate(sibling_ids(request_id, params.n)):
            r = Request(sibling_id, list(prompt_token_ids), params, max_tokens, self.eos_token_ids,
                        cache_salt=cache_salt, index=i, parent_id=request_id, share=share)
            if params.constraint is not None:
                r.matcher = self.grammars.matcher(params.constraint)
            if params.seed is not None:   # where the logits it draws for live (a CPU one would fail on CUDA)
                r.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
            siblings.append(r)
        for r in siblings:
            self._siblings[r.request_id] = r
            self.scheduler.add(r)
        self._requests[request_id] = siblings
        if self._needs_host_tokens(params):
            self._num_sync_choices += len(siblings)

    def _needs_host_tokens(self, params: SamplingParams) -> bool:
        """Whether a request's next step reads its last token on the host (so none may overlap)."""
        k = params.num_speculative_tokens
        return (params.constraint is not None or params.min_tokens > 0 or penalised(params)
                or self.drafts_in_step or (k if k is not None else self.num_speculative_tokens) > 0)

    def abort_requests(self, request_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish the unfinished choices of each id (a caller's id: all its choices; a choice's id:
        that one) with status; their blocks return to the pool now. The caller already knows: no
        output is made. Unknown ids (already finished) are ignored."""
        for request_id in request_ids:
            targets = self._requests.get(request_id)
            if targets is None:
                sibling = self._siblings.get(request_id)
                if sibling is None:
                    continue
                targets = [sibling]
            for r in targets:
                if not r.finished:
                    self.scheduler.finish(r, status)
            self._forget_if_done(targets[0])

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and submit a step; apply the results of the step before it, or (without
        overlap) of this one. -> the outputs of the step applied."""
        overlap = self.async_scheduling and not self._num_sync_choices
        if self._in_flight is not None and not overlap:
            return self._apply_in_flight()   # the next plan needs its tokens on the host
        plan = self.scheduler.schedule(self._prompt_budget())
        if not plan.scheduled:
            return self._apply_in_flight() if self._in_flight is not None else []
        started = time.monotonic()
        masks, failure = None, None
        try:
            # A grammar needs host tokens: with no such choice, no row is constrained.
            masks = (StepMasks.start(self._mask_thread, plan.scheduled, self.drafts_in_step)
                     if self._num_sync_choices else StepMasks())
            pending = self.runner.submit(plan, masks)
        except Exception as error:
            failure = error
        finally:
            if masks is not None:
                masks.wait()   # past the step, only the engine thread touches matchers
        outputs = self._apply_in_flight() if self._in_flight is not None else []
        if failure is not None:
            return outputs + self._recover(plan, failure)
        self._in_flight = InFlight(plan, pending, started)
        if not overlap:
            outputs += self._apply_in_flight()
        return outputs

    def _prompt_budget(self) -> int | None:
        """The prompt tokens the next step may take beside its decodes: limits.max_step_time_s,
        else limits.light_tenant_prefill_ratio while a light tenant is served; None: no bound."""
        step_s, ratio = self.limits.max_step_time_s, self.limits.light_tenant_prefill_ratio
        if step_s:
            return self.load_stats.prompt_budget(self.scheduler.num_decoding(), step_time_s=step_s)
        if ratio and self.scheduler.serves_a_light_tenant():   # once a step: it counts the grace down
            return self.load_stats.prompt_budget(self.scheduler.num_decoding(), decode_ratio=ratio)
        return None

    def _apply_in_flight(self) -> list[EngineCoreOutput]:
        plan, pending, started = self._in_flight
        self._in_flight = None
        results = self.runner.collect(pending)
        now = time.monotonic()
        self.load_stats.record(plan.scheduled, now - started, now)
        updates = self.scheduler.update_from_output(plan, results, now)
        outputs, done, output = [], [], self._output
        for r, new_tokens in updates:
            out = output(r, new_tokens, results)
            outputs.append(out)
            if out.finish_reason is not None:
                done.append(r)
        for r in done:   # after every output: siblings may finish in the same step
            self._forget_if_done(r)
        self._propose()
        return outputs

    def _recover(self, plan: SchedulerOutput, error: Exception) -> list[EngineCoreOutput]:
        """A step that failed before it ran (in its submission or its forward pass): undo its
        schedule, abort the requests it can blame (all of the step's, when the runner cannot say)
        and run the others again."""
        blamed = ({item.request.request_id for item in plan.scheduled} if not isinstance(error, RequestStepError)
                  else set(error.request_ids))
        log.exception("engine step failed; aborting %d of its %d requests", len(blamed), len(plan.scheduled),
                      exc_info=error)
        self.scheduler.roll_back(plan, blamed)
        outputs = []
        for r in (item.request for item in plan.scheduled):
            if r.request_id in blamed:
                outputs += self._abort_caller(r.parent_id)
        return outputs

    def fail_step(self, error: Exception) -> list[EngineCoreOutput]:
        """After a step that failed outside the forward pass (its state half updated): abort what
        was running so the engine stays usable."""
        log.exception("engine step failed; aborting running requests", exc_info=error)
        in_flight = [item.request for item in self._in_flight.plan.scheduled] if self._in_flight else []
        self._in_flight = None
        self.runner.drop_in_flight()
        outputs = []
        for r in list(self.scheduler.running) + in_flight:
            outputs += self._abort_caller(r.parent_id or r.request_id)
        return outputs

    def _abort_caller(self, request_id: str) -> list[EngineCoreOutput]:
        """Abort every unfinished choice of a caller's request on the core's own account: each gets
        its last output (no tokens, finish_reason abort)."""
        siblings = [r for r in self._requests.get(request_id, []) if not r.finished]
        self.abort_requests([request_id])
        return [self._output(r, [], None) for r in siblings]

    def _output(self, r: Request, new_tokens: list[int], results: StepResults | None) -> EngineCoreOutput:
        """r's output: new_tokens, which it took from the step whose results are `results` (None: no
        step, as when the core aborts it)."""
        logprobs = tops = None
        if results is not None and results.with_logprobs and r.params.logprobs:
            logprobs, tops = results.logprobs_of(r.request_id, len(new_tokens))
        status, cached = r.status, r.num_cached_tokens   # plain reads: this runs per choice per step
        return _new_output(EngineCoreOutput, (
            r.request_id, r.parent_id or r.request_id, r.index, new_tokens, logprobs, tops,
            status.value if status.finished else None, len(r.prompt_token_ids), cached if cached > 0 else 0,
            len(r.output_token_ids), r.spec_proposed, r.spec_accepted,
            (r.first_scheduled_time or r.arrival_time) - r.arrival_time))

    def _forget_if_done(self, r: Request) -> None:
        """Drop a caller's request once all its choices have finished."""
        siblings = self._requests.get(r.parent_id, [])
        if all(s.finished for s in siblings):
            self._requests.pop(r.parent_id, None)
            for s in siblings:
                self._siblings.pop(s.request_id, None)
            if siblings and self._needs_host_tokens(siblings[0].params):
                self._num_sync_choices -= len(siblings)

    def _propose(self) -> None:
        """How many draft tokens each decoding request verifies in the next step (and, n-gram,
        which)."""
        if not self._num_sync_choices or (self.proposer is None and not self.drafts_in_step):
            return   # a choice that speculates needs host tokens: with none, none speculates
        default = self.num_speculative_tokens
        for r in self.scheduler.running:
            k = r.params.num_speculative_tokens
            if k is None:
                k = default
            if k <= 0:   # no speculation for it (the default when none is configured)
                continue
            k = min(k, r.max_tokens - r.num_output_tokens - 1, self.limits.max_model_len - r.num_tokens - 1)
            if k > 0 and r.num_computed_tokens == r.num_tokens - 1:
                k = r.draft_length.next_k(k)
                drafts = []
                if k and not self.drafts_in_step:
                    drafts = self.proposer.propose(r.all_token_ids, k)
                    if r.matcher is not None:   # a draft the grammar refuses would only be rejected
                        drafts = drafts[:r.matcher.valid_prefix(drafts)]
                    k = len(drafts)             # the n-gram finds at most k
                self.scheduler.set_draft(r, k, drafts)

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.pool.num_used_blocks, kv_blocks_total=self.pool.num_usable_blocks,
            prefix_cache_queries=self.kv.stats.queries, prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions, load=self.load_stats.snapshot(self.scheduler))

"""The engine: requests in, one scheduled and executed batch per step, outputs out.

Single-threaded by design: the async layer (async_engine.py) owns the thread that calls it.
A request with n > 1 becomes n sibling requests over the same prompt; the prefix cache makes
them share the prompt's full blocks.

Speculative decoding: after each step the engine picks k for every decoding request (its own
or the worker's default, shortened by the adaptive draft length). The n-gram proposer drafts
then, from token ids; a draft model in the runner drafts inside the next step, into the slots
the scheduler reserves for k tokens.

Constrained decoding: each constrained request (each of its n choices) holds its own grammar
matcher, from a grammar compiled once per constraint (structured/compiler.py). A step's masks
are computed on a helper thread while its forward pass runs; the matcher advances only over the
tokens the scheduler accepts (stop_checks.py), and n-gram drafts are cut where the grammar refuses them.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from services.worker.engine.block_pool import BlockPool
from services.worker.engine.fair_queue import FairShare
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.load_stats import LoadSnapshot, LoadStats
from services.worker.engine.model_runner import ModelRunner, RequestStepError
from services.worker.engine.output_processor import RequestOutput, RequestOutputState
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from services.worker.engine.structured.compiler import GrammarCompiler
from services.worker.engine.structured.step_masks import StepMasks
from services.worker.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineLimits:
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool = True
    # Set when every layer (of the model and any draft) attends within this window: blocks
    # wholly outside it return to the pool while a request runs (kv_cache_manager.py).
    sliding_window: int | None = None


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    load: LoadSnapshot = field(default_factory=LoadSnapshot)   # what admission needs (load_stats.py)


class LLMEngine:
    def __init__(self, limits: EngineLimits, runner: ModelRunner, tokenizer: Tokenizer,
                 vocab_size: int, proposer=None, num_speculative_tokens: int = 0) -> None:
        self.limits = limits
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.pool = BlockPool(limits.num_blocks)
        self.kv = KVCacheManager(self.pool, limits.block_size, limits.enable_prefix_caching,
                                 limits.sliding_window)
        self.scheduler = Scheduler(SchedulerConfig(limits.max_num_seqs, limits.max_num_batched_tokens), self.kv)
        self.proposer = proposer   # n-gram: drafts from token ids, before scheduling
        self.drafts_in_step = runner.drafter is not None
        self.num_speculative_tokens = num_speculative_tokens
        self._requests: dict[str, list[Request]] = {}     # caller id -> its n siblings
        self._states: dict[str, RequestOutputState] = {}  # sibling id -> output state
        self.grammars = GrammarCompiler(tokenizer, vocab_size)
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self.load_stats = LoadStats()

    # -- admission ---------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request before it is queued; returns its resolved max_tokens."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        params.validate(self.vocab_size)
        if params.constraint is not None:
            self.grammars.compile(params.constraint)   # cached: add_request finds it again
        room = self.limits.max_model_len - len(prompt_token_ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; this model's context "
                             f"length is {self.limits.max_model_len}")
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"the prompt ({len(prompt_token_ids)} tokens) plus max_tokens "
                             f"({params.max_tokens}) exceeds the context length ({self.limits.max_model_len})")
        return params.max_tokens or room

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str = "", share: FairShare = FairShare()) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.validate(prompt_token_ids, params)
        siblings = []
        for i in range(params.n):
            r = Request(f"{request_id}#{i}" if params.n > 1 else request_id, list(prompt_token_ids), params,
                        max_tokens, self.tokenizer.eos_token_ids, cache_salt=cache_salt, index=i,
                        parent_id=request_id, share=share)
            if params.constraint is not None:
                r.matcher = self.grammars.matcher(params.constraint)
            if params.seed is not None:   # where the logits it draws for live (a CPU one would fail on CUDA)
                r.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
            siblings.append(r)
            self._states[r.request_id] = RequestOutputState(r, self.tokenizer)
            self.scheduler.add(r)
        self._requests[request_id] = siblings

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort every unfinished choice of a request; its blocks return to the pool now."""
        outputs = []
        for r in self._requests.pop(request_id, []):
            state = self._states.pop(r.request_id)
            if not r.finished:
                self.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
                outputs.append(state.abort())
        return outputs

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        started = time.monotonic()
        masks = StepMasks.start(self._mask_thread, plan.scheduled, self.drafts_in_step)
        failure = None
        try:
            results = self.runner.execute(plan.scheduled, masks)
        except Exception as error:
            failure = error
        finally:
            masks.wait()   # past the step, only the engine thread touches matchers
        if failure is not None:
            return self._recover(plan, failure)
        now = time.monotonic()
        self.load_stats.record(plan.scheduled, now - started)
        outputs, finished = [], []
        for r, new_tokens in self.scheduler.update_from_output(plan, results, now):
            output, stop = self._states[r.request_id].process(new_tokens, results[r.request_id])
            if stop is not None:
                self.scheduler.finish(r, RequestStatus.FINISHED_STOPPED, stop_reason=stop)
            if r.finished:
                finished.append(r)
            outputs.append(output)
        for r in finished:   # after every output: siblings may finish in the same step
            self._forget_if_done(r)
        self._propose()
        return outputs

    def _recover(self, plan: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """A step whose forward pass failed, before any request state moved: abort the requests it
        can blame (all of the step's, when the runner cannot say) and run the others again."""
        blamed = ({item.request.request_id for item in plan.scheduled} if not isinstance(error, RequestStepError)
                  else set(error.request_ids))
        log.exception("engine step failed; aborting %d of its %d requests", len(blamed), len(plan.scheduled),
                      exc_info=error)
        self.scheduler.roll_back(plan, blamed)
        outputs = []
        for r in (item.request for item in plan.scheduled):
            if r.request_id in blamed and r.parent_id in self._requests:
                outputs += self.abort_request(r.parent_id)
        return outputs

    def fail_step(self, error: Exception) -> list[RequestOutput]:
        """After a step that failed outside the forward pass (its state half updated): abort what
        was running so the engine stays usable."""
        log.exception("engine step failed; aborting running requests", exc_info=error)
        outputs = []
        for r in list(self.scheduler.running):
            outputs += self.abort_request(r.parent_id or r.request_id)
        return outputs

    def _forget_if_done(self, r: Request) -> None:
        """Drop a caller's request once all its choices have finished."""
        siblings = self._requests.get(r.parent_id, [])
        if all(s.finished for s in siblings):
            self._requests.pop(r.parent_id, None)
            for s in siblings:
                self._states.pop(s.request_id, None)

    def _propose(self) -> None:
        """How many draft tokens each decoding request verifies in the next step (and, n-gram,
        which)."""
        if self.proposer is None and not self.drafts_in_step:
            return
        for r in self.scheduler.running:
            k = r.params.num_speculative_tokens
            k = self.num_speculative_tokens if k is None else k
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

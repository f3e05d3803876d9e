"""The engine in one process: the engine core (engine_core.py: scheduling, KV cache, execution,
token stops) composed with the front end's output processor (output_processor.py: text, stop
strings). Requests in, RequestOutputs out, one step at a time.

Single-threaded by design: the async layer (async_engine.py) owns the thread that calls it. A
worker that runs its core in another process (core_process.py, core_client.py) composes the
same two halves across the process boundary instead.

The attributes tests and benchmarks read (limits, scheduler, pool, kv, runner, grammars, ...)
are the core's.
"""

from __future__ import annotations

from services.worker.engine.core_protocol import EngineLimits, EngineStats  # noqa: F401  (re-exported)
from services.worker.engine.engine_core import EngineCore
from services.worker.engine.fair_queue import FairShare
from services.worker.engine.model_runner import ModelRunner
from services.worker.engine.output_processor import OutputProcessor, RequestOutput
from services.worker.engine.request import RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.model.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, limits: EngineLimits, runner: ModelRunner, tokenizer: Tokenizer,
                 vocab_size: int, proposer=None, num_speculative_tokens: int = 0,
                 async_scheduling: bool = False) -> None:
        self.core = EngineCore(limits, runner, tokenizer, vocab_size, proposer, num_speculative_tokens,
                               async_scheduling)
        self.processor = OutputProcessor(tokenizer)
        self.tokenizer = tokenizer

    # -- the core's parts, for tests, benchmarks and the worker's start ----------------------

    limits = property(lambda self: self.core.limits)
    runner = property(lambda self: self.core.runner)
    vocab_size = property(lambda self: self.core.vocab_size)
    pool = property(lambda self: self.core.pool)
    kv = property(lambda self: self.core.kv)
    scheduler = property(lambda self: self.core.scheduler)
    grammars = property(lambda self: self.core.grammars)
    proposer = property(lambda self: self.core.proposer)
    drafts_in_step = property(lambda self: self.core.drafts_in_step)
    num_speculative_tokens = property(lambda self: self.core.num_speculative_tokens)
    load_stats = property(lambda self: self.core.load_stats)
    _requests = property(lambda self: self.core._requests)     # caller id -> its choices (core)
    _states = property(lambda self: self.processor._states)    # choice id -> text state (front end)

    # -- requests ----------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request before it is queued; returns its resolved max_tokens."""
        return self.core.validate(prompt_token_ids, params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str = "", share: FairShare = FairShare()) -> None:
        self.core.add_request(request_id, prompt_token_ids, params, cache_salt, share)
        self.processor.add_request(request_id, prompt_token_ids, params)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort every unfinished choice of a request; its blocks return to the pool now."""
        self.core.abort_requests([request_id])
        return self.processor.abort(request_id)

    def has_work(self) -> bool:
        return self.core.has_work()

    def step(self) -> list[RequestOutput]:
        return self._process(self.core.step())

    def fail_step(self, error: Exception) -> list[RequestOutput]:
        """After a step that failed outside the forward pass: abort what was running."""
        return self._process(self.core.fail_step(error))

    def _process(self, core_outputs) -> list[RequestOutput]:
        outputs, stopped = self.processor.process(core_outputs)
        if stopped:   # before the next step: the core never runs a choice past its stop string
            self.core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def stats(self) -> EngineStats:
        return self.core.stats()

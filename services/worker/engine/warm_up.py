"""A short synthetic workload through the engine core before the worker serves (SGLang's warm-up
request, vLLM's profile run). The first user request then pays no first-call costs (kernel
compiles, oneDNN's first plans, the allocator's growth), and the load stats hold a decode line and
a prefill rate before anyone's request ran, so the gateway's admission knows the pool's capacity
from its first report. Without them the gateway's limit is its configured fallback until the
first decode-only step: bench-load's cold burst of 32 waited behind 8 streams, 2.3 s on average.

The workload runs twice: the first pass pays the first calls, whose times would skew the figures,
and is forgotten; the second is measured. The line needs decode-only steps at two batch sizes
(load_stats.MIN_SPREAD): one request alone, then a batch. Real steps replace these samples as they
come (load_stats.DECAY). Nothing of the workload stays but evictable prefix-cache blocks of its
made-up prompts.
"""

from __future__ import annotations

import itertools
import time

from services.worker.engine.engine_core import EngineCore
from services.worker.engine.kv_cache_manager import PrefixCacheStats
from services.worker.engine.load_stats import LoadStats
from services.worker.engine.sampling_params import SamplingParams

PROMPT_TOKENS = 128   # the lone request's prompt: a chat's, for the prefill rate
BATCH = 8             # requests decoding together after the lone one
BATCH_PROMPT_TOKENS = 16
DECODE_STEPS = 3      # decode-only steps of each pass


def warm_up(core: EngineCore) -> float:
    """Run the workload to its end; -> the seconds it took. Call before serving, from the thread
    that will drive the core."""
    started = time.monotonic()
    limits = core.limits
    longest = max(1, min(PROMPT_TOKENS, limits.max_model_len - DECODE_STEPS - 1))
    short = max(1, min(BATCH_PROMPT_TOKENS, longest))
    batch = max(1, min(BATCH, limits.max_num_seqs))
    seeds = itertools.count()
    for measured in (False, True):
        if measured:
            core.load_stats = LoadStats()
        _run(core, [_prompt(next(seeds), longest, core.vocab_size)])
        _run(core, [_prompt(next(seeds), short, core.vocab_size) for _ in range(batch)])
    core.kv.stats = PrefixCacheStats()   # the prefix cache's hit rate is its users'
    return time.monotonic() - started


def _prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    """Made-up token ids, different for each seed (so no pass hits another's cached blocks)."""
    return [(seed * 1_000_003 + j * 7_919 + 1) % vocab_size for j in range(length)]


def _run(core: EngineCore, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"warm-up-{i}", prompt, params)
    while core.has_work():
        core.step()

"""The plain data that crosses between the front end and the engine core, and its wire form.

Everything here is light (no torch, no model code): the front-end process imports it, and the
same types serve the in-process engine. On the wire (core_client.py <-> core_process.py) a value
is msgpack: ints, floats, strings, lists and maps only; a NamedTuple travels as its list of fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from services.worker.engine.fair_queue import FairShare
from services.worker.engine.load_stats import LoadSnapshot
from services.worker.engine.sampling_params import Constraint, SamplingParams


class EngineDead(RuntimeError):
    """The engine cannot run another step (its thread or process stopped, a rank failed)."""


@dataclass
class EngineLimits:
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool = True
    max_step_time_s: float = 0.0       # 0: prompt work beside decodes bounded by tokens only (load_stats.py)
    light_tenant_prefill_ratio: float = 1.0  # 0: no bound while a light tenant is served (config.py)
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


class EngineCoreOutput(NamedTuple):
    """What one choice took in one step, or how it ended. A choice that finishes gets exactly one
    output with finish_reason set; an abort the core decides on its own (a failed step) has no
    tokens."""
    request_id: str                     # the choice's (sibling) id
    parent_id: str                      # the caller's id, shared by the n choices
    index: int                          # choice index
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None           # stop | length | abort (RequestStatus values)
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    spec_proposed: int
    spec_accepted: int
    queue_time_s: float                 # arrival to first schedule


def sibling_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's n choices (the core and the front end both name them so)."""
    return [f"{request_id}#{i}" for i in range(n)] if n > 1 else [request_id]


def validate_request(limits: EngineLimits, vocab_size: int, prompt_token_ids: list[int], params: SamplingParams,
                     compile_grammar: Callable[[Constraint], None]) -> int:
    """Check a request before it is queued (ValueError for the caller); returns its resolved max_tokens."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    params.validate(vocab_size)
    if params.constraint is not None:
        compile_grammar(params.constraint)   # cached: adding the request finds it again
    room = limits.max_model_len - len(prompt_token_ids)
    if room < 1:
        raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; this model's context "
                         f"length is {limits.max_model_len}")
    if params.max_tokens is not None and params.max_tokens > room:
        raise ValueError(f"the prompt ({len(prompt_token_ids)} tokens) plus max_tokens "
                         f"({params.max_tokens}) exceeds the context length ({limits.max_model_len})")
    return params.max_tokens or room


# -- wire forms ------------------------------------------------------------------------------

def params_to_wire(params: SamplingParams) -> dict:
    d = dataclasses.asdict(params)
    d["logit_bias"] = [[int(k), float(v)] for k, v in params.logit_bias.items()]   # msgpack maps want str keys
    return d


def params_from_wire(d: dict) -> SamplingParams:
    d = dict(d)
    d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"]}
    if d["constraint"] is not None:
        d["constraint"] = Constraint(**d["constraint"])
    return SamplingParams(**d)


def share_to_wire(share: FairShare) -> list:
    return [share.tenant, share.weight, share.priority]


def share_from_wire(wire: list) -> FairShare:
    return FairShare(wire[0], float(wire[1]), int(wire[2]))


def stats_to_wire(stats: EngineStats) -> dict:
    return dataclasses.asdict(stats)


def stats_from_wire(d: dict) -> EngineStats:
    return EngineStats(**{**d, "load": LoadSnapshot(**d["load"])})


def output_from_wire(wire: list) -> EngineCoreOutput:
    return EngineCoreOutput(*wire)

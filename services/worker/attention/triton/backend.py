"""The Triton attention backend: paged attention for mixed batches, switching to split-KV when a
decode-like batch is too small to fill the GPU (few sequences, long contexts).

What a launch needs besides the layer's own tensors (the checks, the grid, the kernel's constants,
the split count) depends only on the step's metadata and on shapes every layer shares, so it is
planned once per step and kept in the metadata's plans: each layer only launches."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.triton.paged_attention import DEFAULT_TILE_N, launch_config, launch_paged_attention
from services.worker.attention.triton.split_kv import choose_num_splits, launch_split_kv
from services.worker.attention.triton.write_kv import write_kv

# Batches whose sequences have at most this many query tokens (decode, speculative verification)
# run one tile per sequence and KV head, so their parallelism is num_seqs x num_kv_heads.
SPLIT_MAX_QUERY_LEN = 8


@functools.cache
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: splitting only adds work
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonPagedAttention:
    name = "triton"

    def __init__(self, num_sms: int | None = None, tile_n: int = DEFAULT_TILE_N):
        """num_sms: the parallelism to fill (default: the device's multiprocessor count)."""
        self.num_sms = num_sms
        self.tile_n = tile_n

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(key, value, key_cache, value_cache, slot_mapping)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        # Layers that differ in anything the plan holds (window, shapes, strides) get plans of their own.
        key = (self.name, window, scale, query.shape, query.stride(), query.dtype, key_cache.shape,
               key_cache.stride(), value_cache.stride(), key_cache.dtype)
        plan = meta.plans.get(key)
        if plan is None:
            plan = meta.plans[key] = self._plan(query, key_cache, value_cache, meta, scale, window)
        out = torch.empty_like(query)
        if query.shape[0] == 0:
            return out
        kwargs = dict(plan.kwargs, query=query, key_cache=key_cache, value_cache=value_cache)
        if plan.num_splits > 1:
            return launch_split_kv(out, plan.grid, kwargs, plan.num_splits)
        return launch_paged_attention(out, plan.grid, kwargs)

    def _plan(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float, window: int | None) -> _LaunchPlan:
        grid, kwargs = launch_config(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, meta.max_query_len, scale, self.tile_n, window)
        for name in ("query", "key_cache", "value_cache"):   # the layer's own, passed at each launch
            del kwargs[name]
        splits = self.num_splits(meta, num_kv_heads=key_cache.shape[2], device=query.device, window=window)
        return _LaunchPlan(grid, kwargs, splits)

    def num_splits(self, meta: AttentionMetadata, num_kv_heads: int, device: torch.device,
                   window: int | None = None) -> int:
        """Split only contexts long enough within their window: a short window never splits."""
        if meta.max_query_len > SPLIT_MAX_QUERY_LEN:
            return 1
        num_sms = self.num_sms or _multiprocessor_count(device)
        span = meta.max_seq_len if window is None else min(meta.max_seq_len,
                                                             window + meta.max_query_len - 1)
        return choose_num_splits(meta.num_seqs, num_kv_heads, span, num_sms)


@dataclass(frozen=True)
class _LaunchPlan:
    """One step's launch of the attention kernels, checked, for every layer of one shape."""
    grid: tuple[int, int]
    kwargs: dict              # launch_config's, less the layer's query and caches
    num_splits: int

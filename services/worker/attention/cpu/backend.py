"""The CPU attention backend: short query rows in the C kernel, prefill in the PyTorch reference.

Decode and speculative-verification rows (at most MAX_SHORT_QUERY new tokens in their sequence)
go to paged_attention.c, which reads each visible key and value once from the paged cache. The
reference gathers every sequence's blocks into a padded copy, zeroes the padding and runs SDPA
over it: on a 2-core CPU at 32 decode rows of ~400 positions that is about 4x the time per layer.
Longer sequences (prefill chunks) stay on the reference, one SDPA per sequence, which is already
compute-bound. Where the kernel cannot serve a layer (no compiler, a pair of query and cache types
it has no variant for, a head layout past its limits) the whole layer takes the reference, with
the same results within rounding.
"""

from __future__ import annotations

import numpy as np
import torch

from services.worker.attention.cpu import kernel
from services.worker.attention.metadata import AttentionMetadata, check_window
from services.worker.attention.torch_paged import MAX_SHORT_QUERY, GroupPlan, TorchPagedAttention, attend_groups

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


class CpuPagedAttention:
    name = "cpu"

    def __init__(self, paged_kernel: kernel.PagedAttentionKernel | None = None) -> None:
        self.kernel = paged_kernel if paged_kernel is not None else kernel.load()
        self.reference = TorchPagedAttention()
        self.write_kv = self.reference.write_kv

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        if not self._serves(query, key_cache, value_cache):
            return self.reference.attend(query, key_cache, value_cache, meta, scale, window)
        key = (self.name, window)
        plan = meta.plans.get(key)
        if plan is None:
            check_window(window)
            plan = meta.plans[key] = RowPlan(meta, query.device, window)
        num_tokens, num_heads, head_dim = query.shape
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype)
        if plan.num_rows:
            tables = plan.block_tables
            self.kernel.attend_rows(
                kernel_dtypes(query, key_cache), query.data_ptr(), query.stride(0), out.data_ptr(),
                key_cache.data_ptr(), value_cache.data_ptr(), tables.ctypes.data, tables.shape[1],
                plan.rows.ctypes.data, plan.seqs.ctypes.data, plan.starts.ctypes.data, plan.ends.ctypes.data,
                plan.num_rows, num_heads, key_cache.shape[2], head_dim, key_cache.shape[1], scale,
                torch.get_num_threads())
        attend_groups(plan.long, query, key_cache, value_cache, scale, out)
        return out

    def _serves(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
        num_heads, head_dim = query.shape[1:]
        num_kv_heads = key_cache.shape[2]
        return (self.kernel is not None and query.device.type == "cpu"
                and key_cache.dtype == value_cache.dtype
                and kernel_dtypes(query, key_cache) in kernel.PagedAttentionKernel.SYMBOLS
                and query.stride(2) == 1 and query.stride(1) == head_dim
                and key_cache.is_contiguous() and value_cache.is_contiguous()
                and num_heads % num_kv_heads == 0 and self.kernel.supports(num_heads // num_kv_heads, head_dim))


def kernel_dtypes(query: torch.Tensor, cache: torch.Tensor) -> tuple[str | None, str | None]:
    """The kernel variant's key: the query's element type, the cache's (None: one it never has)."""
    return DTYPE_NAMES.get(query.dtype), DTYPE_NAMES.get(cache.dtype)


class RowPlan:
    """One pass's rows for the kernel (int32 arrays, built once and used by every layer): query
    row, sequence and visible positions [start, end) of each row of a short sequence; and the
    reference's plan for the long ones."""

    def __init__(self, meta: AttentionMetadata, device: torch.device, window: int | None) -> None:
        query_lens = np.asarray(meta.query_lens_cpu, np.int64)
        seq_lens = np.asarray(meta.seq_lens_cpu, np.int64)
        short = np.flatnonzero(query_lens <= MAX_SHORT_QUERY)
        counts = query_lens[short]
        seq_of_row = np.repeat(short, counts)
        first_rows = np.concatenate(([0], np.cumsum(query_lens)[:-1]))
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        positions = seq_lens[seq_of_row] - query_lens[seq_of_row] + within   # each row's own position
        ends = positions + 1
        starts = np.zeros_like(ends) if window is None else np.maximum(0, ends - window)
        self.rows = (first_rows[seq_of_row] + within).astype(np.int32)
        self.seqs = seq_of_row.astype(np.int32)
        self.starts, self.ends = starts.astype(np.int32), ends.astype(np.int32)
        self.num_rows = len(self.rows)
        self.block_tables = np.ascontiguousarray(meta.block_tables.cpu().numpy(), np.int32)
        self.long = GroupPlan(meta, device, window, short_queries=False)

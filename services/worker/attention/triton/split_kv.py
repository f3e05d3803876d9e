"""Split-KV paged attention: for long contexts at small batch, where one program per query tile
and KV head would leave most of the GPU idle.

Each query tile's context is cut into num_splits segments of whole TILE_N steps, one program
each (grid axis 2). A program runs the same online-softmax walk as paged_attention.py over its
segment and stores the unnormalised output with its row sum and max; a second kernel merges the
segments of each (token, head) row: out = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s.
Segments cut the positions the tile sees ([its first row's window start, its last row's
position]); every row sees its own position, which some segment holds, so every row's overall max
is finite (segments a row sees nothing of carry max -inf and weigh 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.attention.triton.common import next_pow2
from services.worker.attention.triton.paged_attention import (
    DEFAULT_TILE_N, _attend_range, _load_tile_queries, _locate_query_tile, _tile_kv_range, _tile_rows,
    launch_config)

MIN_SPLIT_TOKENS = 256  # a segment shorter than this costs more to merge than it saves
MAX_SPLITS = 64


@triton.jit
def _split_kv_kernel(
        partial_out, partial_sum, partial_max, query, key_cache, value_cache, block_tables,
        seq_lens, query_start_loc, num_seqs, num_heads, num_splits, qk_scale, window, stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        Q_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        TILE_N: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_tile, q_start, q_len, seq_len = _locate_query_tile(query_start_loc, seq_lens, num_seqs,
                                                              BLOCK_Q)
    if q_tile * BLOCK_Q >= q_len:
        return
    token, head, valid, position = _tile_rows(q_tile, q_len, seq_len, kv_head, BLOCK_M, BLOCK_Q,
                                              Q_PER_KV)
    q = _load_tile_queries(query, q_start, token, head, valid, stride_qt, stride_qh, HEAD_DIM,
                           HEAD_PAD, DTYPE)
    kv_start, kv_end = _tile_kv_range(q_tile, q_len, seq_len, window, BLOCK_Q)
    tiles_per_split = (kv_end - kv_start + TILE_N * num_splits - 1) // (TILE_N * num_splits)
    kv_lo = kv_start + split * tiles_per_split * TILE_N
    kv_hi = tl.minimum(kv_lo + tiles_per_split * TILE_N, kv_end)
    acc, row_sum, row_max = _attend_range(
        q, position, key_cache, value_cache, block_tables + seq.to(tl.int64) * stride_bt, kv_head,
        kv_lo, kv_hi, window, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
        BLOCK_M, TILE_N, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, DTYPE, PRECISION)
    # Partials are [num_tokens, num_heads, num_splits(, HEAD_PAD)], contiguous.
    row = ((q_start + token).to(tl.int64) * num_heads + head) * num_splits + split
    tl.store(partial_sum + row, row_sum, mask=valid)
    tl.store(partial_max + row, row_max, mask=valid)
    dims = tl.arange(0, HEAD_PAD)
    tl.store(partial_out + row[:, None] * HEAD_PAD + dims[None, :], acc, mask=valid[:, None])


@triton.jit
def _merge_splits_kernel(out, partial_out, partial_sum, partial_max, num_heads, num_splits,
                         stride_ot, stride_oh, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                         SPLITS_PAD: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    row = (token.to(tl.int64) * num_heads + head) * num_splits + splits
    seg_max = tl.load(partial_max + row, mask=split_ok, other=float("-inf"))
    seg_sum = tl.load(partial_sum + row, mask=split_ok, other=0.0)
    weight = tl.exp2(seg_max - tl.max(seg_max, 0))  # empty segments: 2^-inf = 0
    dims = tl.arange(0, HEAD_PAD)
    acc = tl.load(partial_out + row[:, None] * HEAD_PAD + dims[None, :], mask=split_ok[:, None],
                  other=0.0)
    merged = tl.sum(acc * weight[:, None], 0) / tl.sum(seg_sum * weight, 0)
    dst = out + token.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh + dims
    tl.store(dst, merged.to(out.dtype.element_ty), mask=dims < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many segments to cut each context into so that about two programs run per SM;
    1 means the plain kernel fills the GPU (or the contexts are too short to split)."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    wanted = -(-2 * num_sms // programs)
    return max(1, min(wanted, MAX_SPLITS, max_seq_len // MIN_SPLIT_TOKENS))


def split_kv_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                       num_splits: int, out: torch.Tensor | None = None,
                       tile_n: int = DEFAULT_TILE_N, window: int | None = None) -> torch.Tensor:
    """paged_attention (same arguments and result) with each context (within its window) cut
    into num_splits segments computed in parallel and merged."""
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty_like(query) if out is None else out
    if query.shape[0] == 0:
        return out
    grid, kwargs = launch_config(query, key_cache, value_cache, block_tables, seq_lens,
                                 query_start_loc, max_query_len, scale, tile_n, window)
    return launch_split_kv(out, grid, kwargs, num_splits)


def launch_split_kv(out: torch.Tensor, grid: tuple[int, int], kwargs: dict, num_splits: int) -> torch.Tensor:
    """The launches alone (split kernel, merge kernel), with a launch_config already checked."""
    query = kwargs["query"]
    num_tokens, num_heads, head_dim = query.shape
    head_pad = kwargs["HEAD_PAD"]
    partial_out = torch.empty(num_tokens, num_heads, num_splits, head_pad, dtype=torch.float32,
                              device=query.device)
    partial_sum = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                              device=query.device)
    partial_max = torch.empty_like(partial_sum)
    _split_kv_kernel[grid + (num_splits,)](
        partial_out=partial_out, partial_sum=partial_sum, partial_max=partial_max,
        num_heads=num_heads, num_splits=num_splits, **kwargs)
    _merge_splits_kernel[(num_tokens, num_heads)](
        out, partial_out, partial_sum, partial_max, num_heads, num_splits, out.stride(0),
        out.stride(1), HEAD_DIM=head_dim, HEAD_PAD=head_pad, SPLITS_PAD=max(2, next_pow2(num_splits)))
    return out

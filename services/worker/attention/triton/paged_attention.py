"""Paged attention for a mixed batch in one launch: decode, prefill, chunked prefill and
speculative verification rows alike.

A program owns one tile of query rows: up to BLOCK_Q consecutive query tokens of one sequence
times the Q_PER_KV query heads that share one KV head (GQA). Each row of the tile is one
(token, head) pair, so every key and value is read once per tile for all heads of its group, and
a decode row (one token) still fills a tl.dot of BLOCK_M >= 16 rows with its heads. The program
walks the sequence's block table TILE_N cached tokens at a time with an online softmax in fp32
(base 2), causal by each row's position: query token j of a sequence with seq_len tokens, q_len
of them new, sits at position seq_len - q_len + j. With a sliding window of W a row also sees
only positions > its own - W, and the walk starts at the first position the tile's first row
sees, so blocks wholly outside the window are never loaded. A layer without a window passes
NO_WINDOW, wider than any context, so one compiled kernel serves both kinds of layer.

The helpers here are shared with the split-KV kernel (split_kv.py), which runs the same walk
over one segment of the context per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.attention.metadata import check_window
from services.worker.attention.triton.common import (
    LOG2_E, check_last_dim_contiguous, compute_dtype, dot_precision, next_pow2)

DEFAULT_TILE_N = 64  # cached tokens per step of the walk; a multiple of 16, may span several blocks
NO_WINDOW = 1 << 30  # the window of a global layer: position - NO_WINDOW stays within int32


@triton.jit
def _locate_query_tile(query_start_loc, seq_lens, num_seqs, BLOCK_Q: tl.constexpr):
    """Maps program_id(0) to (sequence, its query tile, first query row, query_len, seq_len).

    Sequence s owns program ids from query_start_loc[s] // BLOCK_Q + s on: at least as many as
    it has tiles, so the grid is num_tokens // BLOCK_Q + num_seqs and spare programs find their
    tile past the sequence's end (the caller returns)."""
    pid = tl.program_id(0)
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + seq)
    seq_len = tl.load(seq_lens + seq)
    return seq, q_tile, q_start, q_len, seq_len


@triton.jit
def _tile_rows(q_tile, q_len, seq_len, kv_head, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
               Q_PER_KV: tl.constexpr):
    """Row r of a tile is query token q_tile * BLOCK_Q + r // Q_PER_KV of the sequence and head
    kv_head * Q_PER_KV + r % Q_PER_KV. Invalid rows get position -1 and so see no key."""
    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // Q_PER_KV
    head = kv_head * Q_PER_KV + rows % Q_PER_KV
    valid = (rows // Q_PER_KV < BLOCK_Q) & (token < q_len)
    position = tl.where(valid, seq_len - q_len + token, -1)
    return token, head, valid, position


@triton.jit
def _row_offsets(q_start, token, head, stride_t, stride_h):
    return (q_start + token).to(tl.int64) * stride_t + head.to(tl.int64) * stride_h


@triton.jit
def _attend_range(q, position, key_cache, value_cache, block_table, kv_head, kv_lo, kv_hi, window,
                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
                  BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, DTYPE: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Online softmax of the tile's queries over cached positions [kv_lo, kv_hi), each row seeing
    the positions in (its own - window, its own]. Returns the unnormalised output, the row sums
    and the row maxima, all fp32 with scores in base 2 (qk_scale includes log2(e))."""
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for start in range(kv_lo, kv_hi, TILE_N):
        t = start + tl.arange(0, TILE_N)
        t_ok = t < kv_hi
        block = tl.load(block_table + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        offset = (t % BLOCK_SIZE).to(tl.int64)
        k_rows = key_cache + block * stride_kb + offset * stride_kt + kv_head * stride_kh
        v_rows = value_cache + block * stride_vb + offset * stride_vt + kv_head * stride_vh
        k = tl.load(k_rows[None, :] + dims[:, None], mask=dim_ok[:, None] & t_ok[None, :],
                    other=0.0).to(DTYPE)                                    # [HEAD_PAD, TILE_N]
        v = tl.load(v_rows[:, None] + dims[None, :], mask=t_ok[:, None] & dim_ok[None, :],
                    other=0.0).to(DTYPE)                                    # [TILE_N, HEAD_PAD]
        scores = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        visible = (t[None, :] <= position[:, None]) & (t[None, :] > position[:, None] - window) \
            & t_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # A row that has seen no key yet keeps max -inf; shift it by 0 so exp2 gives 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(DTYPE), v, input_precision=PRECISION)
        row_max = new_max
    return acc, row_sum, row_max


@triton.jit
def _tile_kv_range(q_tile, q_len, seq_len, window, BLOCK_Q: tl.constexpr):
    """[lo, hi) of the positions some row of the tile sees: from the first row's window start to
    the last row's own position."""
    first = seq_len - q_len + q_tile * BLOCK_Q
    hi = seq_len - q_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    return tl.maximum(first - window + 1, 0), hi


@triton.jit
def _load_tile_queries(query, q_start, token, head, valid, stride_qt, stride_qh,
                       HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, DTYPE: tl.constexpr):
    dims = tl.arange(0, HEAD_PAD)
    rows = _row_offsets(q_start, token, head, stride_qt, stride_qh)
    mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
    return tl.load(query + rows[:, None] + dims[None, :], mask=mask, other=0.0).to(DTYPE)


@triton.jit
def _paged_attention_kernel(
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, num_seqs,
        qk_scale, window, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh, stride_bt,
        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        Q_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        TILE_N: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    kv_head = tl.program_id(1)
    seq, q_tile, q_start, q_len, seq_len = _locate_query_tile(query_start_loc, seq_lens, num_seqs,
                                                              BLOCK_Q)
    if q_tile * BLOCK_Q >= q_len:
        return
    token, head, valid, position = _tile_rows(q_tile, q_len, seq_len, kv_head, BLOCK_M, BLOCK_Q,
                                              Q_PER_KV)
    q = _load_tile_queries(query, q_start, token, head, valid, stride_qt, stride_qh, HEAD_DIM,
                           HEAD_PAD, DTYPE)
    kv_lo, kv_hi = _tile_kv_range(q_tile, q_len, seq_len, window, BLOCK_Q)
    acc, row_sum, _ = _attend_range(
        q, position, key_cache, value_cache, block_tables + seq.to(tl.int64) * stride_bt, kv_head,
        kv_lo, kv_hi, window, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
        BLOCK_M, TILE_N, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, DTYPE, PRECISION)
    row_sum = tl.where(valid, row_sum, 1.0)
    dims = tl.arange(0, HEAD_PAD)
    rows = _row_offsets(q_start, token, head, stride_ot, stride_oh)
    tl.store(out + rows[:, None] + dims[None, :], (acc / row_sum[:, None]).to(out.dtype.element_ty),
             mask=valid[:, None] & (dims < HEAD_DIM)[None, :])


def launch_config(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                  max_query_len: int, scale: float, tile_n: int,
                  window: int | None) -> tuple[tuple[int, int], dict]:
    """Checks the shapes and returns (grid, keyword arguments) shared by this kernel and the
    split-KV kernel."""
    check_window(window)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache {tuple(value_cache.shape)} != key_cache {tuple(key_cache.shape)}")
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query heads x dim {num_heads}x{head_dim} do not fit the cache's "
                         f"{num_kv_heads}x{cache_head_dim}")
    if tile_n % 16 or tile_n != next_pow2(tile_n):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    check_last_dim_contiguous(query=query, key_cache=key_cache, value_cache=value_cache,
                              block_tables=block_tables)
    q_per_kv = num_heads // num_kv_heads
    # Decode-like batches fill a 16-row tl.dot with the heads of few tokens; longer queries take
    # 64-row tiles so that prefill reuses each key and value across more rows.
    block_m = max(16 if max_query_len * q_per_kv <= 16 else 64, next_pow2(q_per_kv))
    block_q = block_m // q_per_kv
    dtype = compute_dtype(key_cache.dtype)
    grid = (num_tokens // block_q + seq_lens.shape[0], num_kv_heads)
    kwargs = dict(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
        seq_lens=seq_lens, query_start_loc=query_start_loc, num_seqs=seq_lens.shape[0],
        qk_scale=scale * LOG2_E, window=NO_WINDOW if window is None else min(window, NO_WINDOW),
        stride_qt=query.stride(0), stride_qh=query.stride(1),
        stride_kb=key_cache.stride(0), stride_kt=key_cache.stride(1), stride_kh=key_cache.stride(2),
        stride_vb=value_cache.stride(0), stride_vt=value_cache.stride(1),
        stride_vh=value_cache.stride(2), stride_bt=block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_PAD=next_pow2(head_dim), BLOCK_SIZE=block_size, Q_PER_KV=q_per_kv,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n, DTYPE=dtype,
        PRECISION=dot_precision(dtype), num_warps=4 if block_m <= 16 else 8)
    return grid, kwargs


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                    out: torch.Tensor | None = None, tile_n: int = DEFAULT_TILE_N,
                    window: int | None = None) -> torch.Tensor:
    """Attention of query [num_tokens, num_heads, head_dim] over the paged caches
    [num_blocks, block_size, num_kv_heads, head_dim]; returns [num_tokens, num_heads, head_dim].

    block_tables int32 [num_seqs, max_blocks], seq_lens int32 [num_seqs] (context after this
    pass), query_start_loc int32 [num_seqs + 1]; see metadata.py for the layout. window: a
    sliding window of that many positions, or None for full causal attention."""
    out = torch.empty_like(query) if out is None else out
    if query.shape[0] == 0:
        return out
    grid, kwargs = launch_config(query, key_cache, value_cache, block_tables, seq_lens,
                                 query_start_loc, max_query_len, scale, tile_n, window)
    return launch_paged_attention(out, grid, kwargs)


def launch_paged_attention(out: torch.Tensor, grid: tuple[int, int], kwargs: dict) -> torch.Tensor:
    """The kernel launch alone, with a launch_config already checked (the backend plans once per
    step and launches in every layer)."""
    _paged_attention_kernel[grid](out=out, stride_ot=out.stride(0), stride_oh=out.stride(1), **kwargs)
    return out

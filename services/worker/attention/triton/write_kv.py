"""Writes the new tokens' keys and values into their slots of the paged caches.

One program per token copies its [num_kv_heads, head_dim] key and value; slot = block *
block_size + offset (metadata.py). A negative slot marks a padding token and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.attention.triton.common import check_last_dim_contiguous, next_pow2


@triton.jit
def _write_kv_kernel(key, value, key_cache, value_cache, slot_mapping, num_kv_heads, stride_kt,
                     stride_kh, stride_vt, stride_vh, stride_kcb, stride_kct, stride_kch,
                     stride_vcb, stride_vct, stride_vch, BLOCK_SIZE: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    k = tl.load(key + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value + token * stride_vt + heads * stride_vh + dims, mask=mask)
    k_dst = key_cache + block * stride_kcb + offset * stride_kct + heads * stride_kch + dims
    v_dst = value_cache + block * stride_vcb + offset * stride_vct + heads * stride_vch + dims
    tl.store(k_dst, k.to(key_cache.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(value_cache.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value [num_tokens, num_kv_heads, head_dim] into the caches [num_blocks, block_size,
    num_kv_heads, head_dim] at slot_mapping (int64 [num_tokens], -1 = skip)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or key_cache.shape[2:] != key.shape[1:] \
            or value_cache.shape != key_cache.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"write_kv shapes do not fit: key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}, caches {tuple(key_cache.shape)} / "
                         f"{tuple(value_cache.shape)}, slots {tuple(slot_mapping.shape)}")
    check_last_dim_contiguous(key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, num_kv_heads, key.stride(0),
        key.stride(1), value.stride(0), value.stride(1), *key_cache.stride()[:3],
        *value_cache.stride()[:3], BLOCK_SIZE=key_cache.shape[1], HEAD_DIM=head_dim,
        HEADS_PAD=next_pow2(num_kv_heads), HEAD_PAD=next_pow2(head_dim))

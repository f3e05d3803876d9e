"""Rotary position embedding, rotate-half layout (Hugging Face Llama): the first and second
halves of each head are the two coordinates of each rotated pair.

cos and sin are the model's per-position tables [max_positions, head_dim / 2] in fp32 (any
frequency scaling already applied, as services/worker/model/rotary.py builds them). Queries and
keys are best rotated together as one [tokens, num_heads + num_kv_heads, head_dim] view.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.attention.triton.common import next_pow2


@triton.jit
def _rotary_kernel(x, out, positions, cos, sin, num_heads, stride_xt, stride_xh, stride_ot,
                   stride_oh, stride_cos, stride_sin, HALF: tl.constexpr, HEADS_PAD: tl.constexpr,
                   HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    c = tl.load(cos + pos * stride_cos + dims, mask=dims < HALF, other=0.0)
    s = tl.load(sin + pos * stride_sin + dims, mask=dims < HALF, other=0.0)
    src = x + token * stride_xt + heads * stride_xh + dims
    dst = out + token * stride_ot + heads * stride_oh + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * c - x2 * s).to(out.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(out.dtype.element_ty), mask=mask)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim] (may be a strided view, e.g. of a fused qkv
    projection), positions int [num_tokens] -> x rotated, a new contiguous tensor of x's dtype."""
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    if head_dim % 2 or positions.shape != (num_tokens,):
        raise ValueError(f"rotary needs an even head_dim and one position per token, got x "
                         f"{tuple(x.shape)}, positions {tuple(positions.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != half:
        raise ValueError(f"cos and sin must be [max_positions, {half}], got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("x, cos and sin must be contiguous in their last dimension")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            x, out, positions, cos, sin, num_heads, x.stride(0), x.stride(1), out.stride(0),
            out.stride(1), cos.stride(0), sin.stride(0), HALF=half, HEADS_PAD=next_pow2(num_heads),
            HALF_PAD=next_pow2(half))
    return out


def apply_rotary_reference(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> torch.Tensor:
    c = cos[positions.long()].float()[:, None, :]
    s = sin[positions.long()].float()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

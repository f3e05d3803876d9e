"""RMSNorm, optionally fused with the residual add before it (one read of each input).

    add_rms_norm(x, residual, w, eps) -> (rms_norm(x + residual, w, eps), x + residual)

The sum is rounded to the input dtype once (what the model keeps as its residual stream); the
norm is computed in fp32 and rounded once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.attention.triton.common import next_pow2


@triton.jit
def _rms_norm_kernel(x, residual, weight, out, residual_out, hidden, eps, stride_x, stride_r,
                     stride_o, stride_ro, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h = h.to(residual_out.dtype.element_ty)
        tl.store(residual_out + row * stride_ro + cols, h, mask=mask)
        h = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, 0) / hidden + eps)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + cols, (h * inv_rms * w).to(out.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit hidden size {hidden}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    rows = x.reshape(-1, hidden).contiguous()
    out = torch.empty_like(rows)
    res_rows = rows if residual is None else residual.reshape(-1, hidden).contiguous()
    res_out = torch.empty_like(rows) if residual is not None else out
    block = next_pow2(hidden)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res_rows, weight.contiguous(), out, res_out, hidden, eps, rows.stride(0),
            res_rows.stride(0), out.stride(0), res_out.stride(0), HAS_RESIDUAL=residual is not None,
            BLOCK=block, num_warps=min(8, max(4, block // 256)))
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] -> x / sqrt(mean(x^2) + eps) * weight, in x's dtype."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), both in x's dtype."""
    return _launch(x, residual, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed

"""SiLU-and-multiply of a fused gate/up projection: x [..., 2F] -> silu(x[..., :F]) * x[..., F:],
computed in fp32 and rounded once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x, out, width, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out + row * stride_o + cols, y.to(out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2F] (gate then up) -> [..., F] in x's dtype."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dimension must be even (gate and up halves), got {x.shape[-1]}")
    width = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * width).contiguous()
    out = torch.empty(rows.shape[0], width, dtype=x.dtype, device=x.device)
    if rows.shape[0] and width:
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(width, BLOCK))](
            rows, out, width, rows.stride(0), out.stride(0), BLOCK=BLOCK)
    return out.view(*x.shape[:-1], width)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)

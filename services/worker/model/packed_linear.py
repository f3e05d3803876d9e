"""Linear weights reordered once, at load, into oneDNN's blocked layout: CPU serving in float32
or bfloat16.

A plain x @ W on a CPU has oneDNN (bfloat16) or MKL (float32) copy W into its kernel's blocked
layout on every call: the model's weights are read and written once more each step. Reordered
once, the products of SmolLM2-135M's decode step of 32 in bfloat16 took 55-59 ms instead of 119
(2-core Sapphire Rapids VM; docs/perf/engine.md). The layout is chosen for BATCH_HINT rows;
measured as fast as the best per-size layout from 1 row to 512 (decode to a prefill chunk).

Packing replaces each Linear module (its dense weight goes: a tied head's embedding stays) and is
checked on the first one against the plain product; a CPU build whose oneDNN lacks the ops, or
differs, keeps the plain linears.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from services.worker.model.layers import Linear, RowParallelLinear

log = logging.getLogger(__name__)

BATCH_HINT = 32
DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """y = x W^T + b, W in oneDNN's layout; a row-parallel shard all-reduces before its bias."""

    def __init__(self, linear: Linear):
        super().__init__()
        weight = linear.weight_t.detach().t().contiguous()   # [out, in]
        self.out_features, self.in_features = weight.shape
        self.bytes = weight.numel() * weight.element_size()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        self.tp = linear.tp if isinstance(linear, RowParallelLinear) and linear.tp.size > 1 else None
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return _product(x, self._packed, self.bias)
        y = self.tp.all_reduce(_product(x, self._packed, None))
        return y if self.bias is None else y + self.bias

    def weight_bytes(self) -> int:
        return self.bytes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN layout"


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every Linear of a float32 or bfloat16 CPU model by a PackedLinear, in place.
    -> how many were packed (0: the model's device or dtype has no packed kernels, or this
    build's packed product failed its check; the model is left as it was)."""
    linears = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, Linear)]
    if not linears or not torch.backends.mkldnn.is_available():
        return 0
    first = linears[0][2].weight_t
    if first.device.type != "cpu" or first.dtype not in DTYPES:
        return 0
    if not _packs_correctly(linears[0][2]):
        return 0
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child))
    return len(linears)


@torch.inference_mode()
def _packs_correctly(linear: Linear) -> bool:
    x = torch.randn(3, linear.weight_t.shape[0], generator=torch.Generator().manual_seed(0)).to(linear.weight_t.dtype)
    try:
        packed = PackedLinear(linear)
        got, want = _product(x, packed._packed, linear.bias), Linear.forward(linear, x)
    except (RuntimeError, AttributeError, NotImplementedError) as error:
        log.warning("linear weights stay unpacked: oneDNN's packed product is missing here (%s)", error)
        return False
    if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
        log.warning("linear weights stay unpacked: oneDNN's packed product differs from the plain one")
        return False
    return True

"""Int8 weights for CPU serving: linears on PyTorch's x86 quantized kernels (FBGEMM), with
activations carried at about 13 bits so that outputs stay close to float32.

Decode on a CPU is bound by reading the weights, so storing them as int8 (one scale per output
channel) reads a quarter of float32's bytes, and the int8 kernels cost nearly the same for 1 row
as for 8, which is what speculative verification and small batches need.

The kernel quantizes its float input to 7-bit integers with one range for the whole input, and
LLM activations (outlier channels ~12x their RMS) lose several percent to that. So each row is
sent twice, split where the kernel's grid would cut it:
  - a guard row holding -1 and 1 pins the kernel's range to exactly [-1, 1], hence its grid
    to steps of 2/127; each row is scaled so that its absolute maximum is 63 steps;
  - `hi` is the scaled row rounded onto that grid (the kernel reproduces it exactly), `lo` the
    remainder in steps, within [-0.5, 0.5], quantized by the kernel on the same grid;
  - y = (W hi + W lo * step), scaled back.
Both parts go through one kernel call, so the weights are read once. A row's result depends on
that row alone (the int32 accumulation is exact), so a request's output is the same alone or in
any batch, as in float32. Measured on SmolLM2: 0.4% relative error per linear against 3% for a
single pass, the weights' own int8 rounding (0.7%) being the rest.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from services.worker.model.layers import Linear

# FBGEMM multiplies uint8 activations by int8 weights in int16 pairs on CPUs without VNNI;
# 7-bit activations keep those sums from saturating (what PyTorch's own dynamic quantization
# does on x86). With the range pinned to [-1, 1] the kernel's grid is then 2/127 with zero at 64.
_REDUCE_RANGE = True
_STEP = 2.0 / 127
_MAX_UNITS = 63
_TINY = 1e-12


class Int8Linear(nn.Module):
    """y = x W^T + b, W int8 with a float scale per output channel; x and y float32."""

    def __init__(self, linear: Linear):
        super().__init__()
        weight = linear.weight_t.detach().t().float()                  # [out, in]
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=_TINY).double()
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():
            # PyTorch marks quantized tensor creation deprecated (no replacement CPU kernel yet).
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        # The bias is added after scaling back, so the kernel gets none.
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self._guard = torch.zeros(1, self.in_features)
        self._guard[0, :2] = torch.tensor([-1.0, 1.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        # A unit is 1/63 of the row's maximum, so hi stays within 63 steps: inside the guard's range.
        unit = x.abs().amax(dim=-1, keepdim=True).clamp_(min=_TINY).div_(_MAX_UNITS)
        units = x / unit
        hi_units = torch.round(units)
        lo_units = units.sub_(hi_units)                                  # in [-0.5, 0.5]
        both = torch.cat([hi_units.mul_(_STEP), lo_units, self._guard])
        y = torch.ops.quantized.linear_dynamic(both, self._packed, _REDUCE_RANGE)
        # W hi = y_hi / step and W lo = y_lo, both in units.
        y = torch.add(y[:rows], y[rows:2 * rows], alpha=_STEP).mul_(unit.div_(_STEP))
        return y if self.bias is None else y.add_(self.bias)

    def weight_bytes(self) -> int:
        return self.in_features * self.out_features + 8 * self.out_features   # int8 + scale/zero point

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every float Linear of a float32 CPU model by an Int8Linear, in place."""
    first = next(model.parameters())
    if first.device.type != "cpu" or first.dtype != torch.float32:
        raise ValueError(f"int8 quantization runs on CPU float32 models, not {first.device.type} {first.dtype}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, Int8Linear(child))
    return model

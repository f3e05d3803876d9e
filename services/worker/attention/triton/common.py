"""Host-side helpers shared by the Triton kernels' launchers."""

from __future__ import annotations

import os

import torch
import triton.language as tl

LOG2_E = 1.4426950408889634

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def compute_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype tensors of `dtype` are converted to right after loading, for tl.dot and arithmetic.

    16-bit storage stays 16-bit for the tensor cores (with fp32 accumulation), except bfloat16
    under the interpreter, whose bfloat16 arithmetic is wrong or crashes.
    """
    if dtype not in _TL_DTYPES:
        raise TypeError(f"unsupported dtype {dtype} (float16, bfloat16, float32)")
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return _TL_DTYPES[dtype]


def dot_precision(dtype: tl.dtype) -> str:
    """float32 operands are multiplied exactly; Triton's default would round them to tf32."""
    return "ieee" if dtype == tl.float32 else "tf32"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")

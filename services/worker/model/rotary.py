"""Rotary position embeddings (the "rotate half" layout Hugging Face Llama uses), with Llama 3 scaling.

cos and sin are computed once for every position up to the context length, in float32, exactly as
the reference computes them, and looked up by position in each forward pass.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling is not None:
            inv_freq = _llama3_scaled(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos().to(device), persistent=False)   # [P, head_dim/2]
        self.register_buffer("sin", freqs.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's angles, [T, 1, head_dim/2]: looked up once, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim], rotated pairwise (i, i + head_dim/2) by each token's angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: slow down low frequencies by `factor`, keep high ones, blend those in between."""
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (only 'llama3' is supported)")
    try:
        factor, low_freq_factor, high_freq_factor, old_context = (float(scaling[key]) for key in _LLAMA3_KEYS)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"rope_scaling 'llama3' needs numbers {', '.join(_LLAMA3_KEYS)}; got {scaling}") from e
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)

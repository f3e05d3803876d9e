"""Rotary position embeddings (the "rotate half" layout Hugging Face uses) with every Llama-family
scaling transformers knows: linear, dynamic NTK, YaRN, LongRoPE (Phi-3) and Llama 3.

cos and sin are computed once for every position up to the context length, in float32, with the
reference's formulas (transformers' modeling_rope_utils), and looked up by position in each
forward pass. Partial rotary (rotary_dim < head_dim) rotates a head's first rotary_dim dims.

Two scalings depend on the sequence length in transformers (dynamic NTK past
original_max_position_embeddings, LongRoPE's long factors past it): there the angles of a token at
position p are those transformers uses when it decodes that token (sequence length p + 1), so a
token's rotation never depends on how the engine batches or chunks its sequence.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device, rotary_dim: int | None = None):
        super().__init__()
        dim = rotary_dim or head_dim
        freqs, attention_factor = _angles(dim, max_positions, theta, scaling)    # [P, dim/2]
        self.register_buffer("cos", (freqs.cos() * attention_factor).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention_factor).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's angles, [T, 1, rotary_dim/2]: looked up once, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim], its first 2 * cos.shape[-1] dims rotated pairwise (i, i + half)."""
    rotary_dim = 2 * cos.shape[-1]
    rotated, passed = (x, None) if rotary_dim == x.shape[-1] else (x[..., :rotary_dim], x[..., rotary_dim:])
    x1, x2 = rotated.chunk(2, dim=-1)
    out = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    return torch.cat(out if passed is None else (*out, passed), dim=-1)


def _inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _angles(dim: int, max_positions: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """-> the angle of every (position, frequency) pair [P, dim/2], and the factor on cos and sin."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    if scaling is None:
        return torch.outer(positions, _inv_freq(theta, dim)), 1.0
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in _SCALINGS:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: {', '.join(_SCALINGS)})")
    keys, compute = _SCALINGS[rope_type]
    numbers = _numbers(rope_type, scaling, keys)
    return compute(positions, theta, dim, scaling, *numbers)


def _numbers(rope_type: str, scaling: dict, keys: tuple[str, ...]) -> list[float]:
    try:
        values = [float(scaling[key]) for key in keys]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"rope_scaling {rope_type!r} needs numbers {', '.join(keys)}; got {scaling}") from e
    if any(v <= 0 for v in values):
        raise ValueError(f"rope_scaling {rope_type!r}: {', '.join(keys)} must be positive; got {scaling}")
    return values


def _linear(positions, theta, dim, scaling, factor):
    return torch.outer(positions, _inv_freq(theta, dim) / factor), 1.0


def _llama3(positions, theta, dim, scaling, factor, low_freq_factor, high_freq_factor, old_context):
    """Llama 3.1: slow down low frequencies by `factor`, keep high ones, blend those in between."""
    inv_freq = _inv_freq(theta, dim)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.outer(positions, torch.where(is_medium, blended, scaled)), 1.0


def _dynamic(positions, theta, dim, scaling, factor, original):
    """NTK-aware: past `original` positions the base grows with the sequence length."""
    seq_len = torch.maximum(positions.long() + 1, torch.tensor(int(original)))
    base = theta * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))           # [P]
    inv_freq = 1.0 / (base[:, None] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)[None, :])
    plain = torch.outer(positions, _inv_freq(theta, dim))
    return torch.where((positions + 1 > original)[:, None], positions[:, None] * inv_freq, plain), 1.0


def _yarn(positions, theta, dim, scaling, factor, original):
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return torch.outer(positions, inv_freq), float(attention_factor)


def _longrope(positions, theta, dim, scaling, factor, original):
    """Phi-3: per-frequency rescaling, short factors within the pretraining length, long past it."""
    factors = []
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if not isinstance(values, list) or len(values) != dim // 2:
            raise ValueError(f"rope_scaling 'longrope' needs {key}: a list of {dim // 2} numbers; got {values!r}")
        factors.append(torch.tensor(values, dtype=torch.float32))
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short, long = (torch.outer(positions, 1.0 / (f * theta ** shape)) for f in factors)
    return torch.where((positions + 1 > original)[:, None], long, short), float(attention_factor)


_SCALINGS = {
    "linear": (("factor",), _linear),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), _llama3),
    "dynamic": (("factor", "original_max_position_embeddings"), _dynamic),
    "yarn": (("factor", "original_max_position_embeddings"), _yarn),
    "longrope": (("factor", "original_max_position_embeddings"), _longrope),
}

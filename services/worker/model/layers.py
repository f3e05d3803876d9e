"""The blocks every decoder family shares: linear, embedding, RMS norm, attention over the paged
KV cache, the gated MLP and the pre-norm decoder layer.

Input is the flattened batch of new tokens, [T, hidden]: every sequence's tokens one after
another as AttentionMetadata describes. Q/K/V and gate/up are each one fused linear so a decode
step runs few, large matrix products; the attention backend writes the new keys and values into
the cache and attends over it. Parameters are allocated uninitialised; the model's load_weights
(decoder.py) or random init fills them.

Tensor parallelism (a TensorParallel group of size > 1, Megatron's split): q/k/v and gate/up are
column-parallel (each rank holds its heads and its share of the intermediate features), o and
down row-parallel (each rank's partial product, then one all-reduce), the embedding and head
split by vocabulary. A split parameter carries `tp_split` (TPSplit): the loader cuts this rank's
piece out of each full checkpoint tensor with it (decoder.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.backend import AttentionBackend
from services.worker.attention.metadata import AttentionMetadata
from services.worker.model.config import ModelConfig
from services.worker.model.rotary import apply_rotary
from services.worker.parallel.group import SINGLE, TensorParallel, local_kv_heads

Rotary = tuple[torch.Tensor, torch.Tensor]          # cos, sin of each token, [T, 1, rotary_dim/2]
KVCache = tuple[torch.Tensor, torch.Tensor]


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))


class RMSNorm(nn.Module):
    unit_weight = 1.0     # the weight that makes the norm a plain normalisation (random init)

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _empty(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Half precision: normalise in float32 and round before scaling, as the reference does.
        return F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype) * self.weight


@dataclass(frozen=True)
class TPSplit:
    """How a parameter is split across ranks, in its Hugging Face view ([out, in] for a Linear
    weight): along `dim`, as the segments `full` (one after another: q, k, v of a fused QKV) of
    which this rank holds `local` each."""
    dim: int
    full: tuple[int, ...]
    local: tuple[int, ...]


def split(param: nn.Parameter, dim: int, full: tuple[int, ...], local: tuple[int, ...]) -> nn.Parameter:
    param.tp_split = TPSplit(dim, tuple(full), tuple(local))
    return param


class Linear(nn.Module):
    """y = x W^T + b with W stored transposed, [in, out], and left uninitialised for the loader.

    The transposed layout streams contiguous rows in a batch-1 product: on the 2-core AVX2 CPU it
    made decode matmuls about 1.5x faster than nn.Linear's [out, in], and no slower for prefill.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device):
        super().__init__()
        self.weight_t = _empty(in_features, out_features, dtype=dtype, device=device)
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight_t if self.bias is None else torch.addmm(self.bias, x, self.weight_t)


class ColumnParallelLinear(Linear):
    """Output features split: this rank computes its `local` of each `full` output segment
    (no communication; the next layer consumes the split output)."""

    def __init__(self, in_features: int, full: tuple[int, ...], local: tuple[int, ...], bias: bool, dtype, device):
        super().__init__(in_features, sum(local), bias, dtype, device)
        split(self.weight_t, -2, full, local)
        if bias:
            split(self.bias, -1, full, local)


class RowParallelLinear(Linear):
    """Input features split: each rank multiplies its share, one all-reduce sums the partial
    products, and the (replicated) bias is added once, after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, dtype, device):
        super().__init__(in_features // tp.size, out_features, bias, dtype, device)
        split(self.weight_t, -1, (in_features,), (in_features // tp.size,))
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(x @ self.weight_t)
        return y if self.bias is None else y + self.bias


class Embedding(nn.Module):
    """Vocabulary-parallel over a group: each rank holds the rows of its vocabulary share, looks
    up the ids that fall in it (zeros for the others), and an all-reduce assembles the rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype, device, tp: TensorParallel = SINGLE):
        super().__init__()
        rows = num_embeddings // tp.size
        self.weight = split(_empty(rows, embedding_dim, dtype=dtype, device=device), -2, (num_embeddings,), (rows,))
        self.tp, self.start = tp, tp.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(x)


class Attention(nn.Module):
    """Fused QKV, optional per-head q/k norms (Qwen3, Gemma 3), rotary, paged attention (with the
    layer's sliding window, if any), output projection."""

    def __init__(self, config: ModelConfig, layer: int, attention: AttentionBackend, norm: type[RMSNorm],
                 dtype, device, tp: TensorParallel = SINGLE):
        super().__init__()
        # This rank's heads; its KV heads are those its query heads read (replicated when fewer than ranks).
        self.num_heads, self.head_dim = config.num_heads // tp.size, config.head_dim
        self.num_kv_heads = local_kv_heads(config.num_kv_heads, tp.size)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale or config.head_dim ** -0.5
        self.window = config.window(layer)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, (config.q_size, config.kv_size, config.kv_size),
                                             (self.q_size, self.kv_size, self.kv_size), config.qkv_bias, dtype, device)
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, config.o_proj_bias, tp, dtype, device)
        self.q_norm = norm(config.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.k_norm = norm(config.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.attention = attention

    def forward(self, x: torch.Tensor, rotary: Rotary, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, :self.q_size + self.kv_size].view(tokens, -1, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # Queries and keys are rotated together: one rotary pass over num_heads + num_kv_heads heads.
        q, k = apply_rotary(qk, *rotary).split([self.num_heads, self.num_kv_heads], dim=1)
        key_cache, value_cache = kv_cache
        self.attention.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        out = self.attention.attend(q, key_cache, value_cache, meta, self.scale, window=self.window)
        return self.o_proj(out.reshape(tokens, self.q_size))


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(name: str):
    return _ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with SiLU, GeGLU with GELU."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, dtype, device,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        local = intermediate_size // tp.size
        self.gate_up_proj = ColumnParallelLinear(hidden_size, (intermediate_size,) * 2, (local,) * 2, False,
                                                 dtype, device)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, tp, dtype, device)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer: int, attention: AttentionBackend, mlp: nn.Module,
                 dtype, device, norm: type[RMSNorm] = RMSNorm, tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, layer, attention, norm, dtype, device, tp)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rotary: Rotary, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

"""The Llama architecture (SmolLM2, Llama 2/3, Qwen2 with its q/k/v biases) over a paged KV cache.

Input is the flattened batch of new tokens: input_ids and positions are [T], every sequence's
tokens one after another as AttentionMetadata describes. Q/K/V and gate/up are each one fused
linear so a decode step runs few, large matrix products; the attention backend writes the new
keys and values into the cache and attends over it.

Weights arrive under Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...), whatever
the file format: `load_weights` copies each into its slice of the fused parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.backend import AttentionBackend
from services.worker.attention.metadata import AttentionMetadata
from services.worker.model.config import ModelConfig
from services.worker.model.rotary import RotaryEmbedding, apply_rotary

# Tensors some checkpoints carry that the model recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _empty(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Half precision: normalise in float32 and round before scaling, as the reference does.
        return F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype) * self.weight


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


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype, device):
        super().__init__()
        self.weight = _empty(num_embeddings, embedding_dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, dtype, device):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_proj_bias, dtype, device)
        self.attention = attention

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # Queries and keys are rotated together: one rotary pass over num_heads + num_kv_heads heads.
        qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(tokens, -1, self.head_dim), *rotary)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        self.attention.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        out = self.attention.attend(q, key_cache, value_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, dtype, device)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(config, attention, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(config, dtype, device)

    def forward(self, x, rotary, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Parameters are allocated uninitialised on `device`; fill them with load_weights (or random init)."""

    def __init__(self, config: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.head_dim, config.max_context_length, config.rope_theta,
                                      config.rope_scaling, device)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, attention, dtype, device)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        # Tied or not, the head is its own transposed matrix (a tied one is filled from the embedding):
        # the lookup wants the embedding's rows, the product its columns.
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """-> [T, hidden], after the final norm: pick the rows you need and call compute_logits."""
        x = self.embed_tokens(input_ids)
        rotary = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rotary, kv_cache, meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head(hidden).float()

    def decode_weight_bytes(self) -> int:
        """Bytes of weights a decode step reads: everything but the embedding table (a row of it).

        Counts quantized linears (which hold packed weights, not parameters) by their own report.
        """
        params = sum(p.numel() * p.element_size() for name, p in self.named_parameters()
                     if not name.startswith("embed_tokens."))
        packed = sum(m.weight_bytes() for m in self.modules() if hasattr(m, "weight_bytes"))
        return params + packed

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters; every parameter must be filled.

        Raises ValueError on an unknown name, a wrong shape or a missing tensor.
        """
        params = dict(self.named_parameters())
        filled: dict[str, int] = {name: 0 for name in params}
        tied = self.config.tie_word_embeddings
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES) or (tied and hf_name == "lm_head.weight"):
                continue  # some tied checkpoints store the head anyway: it is the embedding
            targets = [self._place(hf_name)]
            if tied and hf_name == "model.embed_tokens.weight":
                targets.append(("lm_head.weight", slice(None)))
            for name, rows in targets:
                transposed = name + "_t" in params   # a Linear weight, stored [in, out]
                name = name + "_t" if transposed else name
                if name not in params:
                    raise ValueError(f"unexpected tensor {hf_name!r} in checkpoint")
                target = params[name].data[:, rows] if transposed else params[name].data[rows]
                source = tensor.t() if transposed else tensor
                if target.shape != source.shape:
                    raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(target.t().shape if transposed else target.shape)}")
                target.copy_(source)
                filled[name] += target.numel()
        missing = [name for name, param in params.items() if filled[name] != param.numel()]
        if missing:
            raise ValueError(f"checkpoint lacks tensors for {len(missing)} parameters, e.g. {missing[:3]}")

    def _place(self, hf_name: str) -> tuple[str, slice]:
        """Hugging Face tensor name -> (our parameter name, its rows in that parameter)."""
        c = self.config
        name = hf_name.removeprefix("model.")
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, c.q_size),
            "self_attn.k_proj": ("self_attn.qkv_proj", c.q_size, c.kv_size),
            "self_attn.v_proj": ("self_attn.qkv_proj", c.q_size + c.kv_size, c.kv_size),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, c.intermediate_size),
            "mlp.up_proj": ("mlp.gate_up_proj", c.intermediate_size, c.intermediate_size),
        }
        for part, (fused_part, start, size) in fused.items():
            if f".{part}." in name:
                return name.replace(part, fused_part), slice(start, start + size)
        return name, slice(None)

"""The shape of a Llama-family model, whatever format its weights came from.

Loaders fill it from GGUF metadata, a Hugging Face config.json or a named random shape; the model,
the KV cache sizing and the engine read it and nothing else.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "max_context_length")


@dataclass
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_context_length: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    # Llama 3.1+ style: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None for plain rotary.
    rope_scaling: dict | None = None
    qkv_bias: bool = False       # Qwen2; Llama with attention_bias
    o_proj_bias: bool = False    # Llama with attention_bias

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
            setattr(self, name, int(value))
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive number, got {value!r}")
            setattr(self, name, float(value))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

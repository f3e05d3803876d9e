"""The shape of a decoder-only model, whatever format its weights came from.

Loaders fill it from GGUF metadata, a Hugging Face config.json (hf_config.py) or a named random
shape; the model, the KV cache sizing and the engine read it and nothing else. `architecture`
names the family module that builds the model (families.py); every other field is a plain
number or switch that family reads, so one family can serve several model types.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
ACTIVATIONS = ("silu", "gelu_tanh")

_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "max_context_length")


@dataclass
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int       # the dense MLP's; an MoE expert's is moe_intermediate_size
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
    # Scaled rotary of the full-attention layers: {"rope_type": "linear" | "dynamic" | "yarn" |
    # "longrope" | "llama3", and that type's numbers} (rotary.py); None for plain rotary.
    rope_scaling: dict | None = None
    architecture: str = "llama"
    qkv_bias: bool = False       # Qwen2; Llama, Qwen3, Gemma 3 with attention_bias
    o_proj_bias: bool = False    # Llama, Qwen3, Gemma 3 with attention_bias
    qk_norm: bool = False        # Qwen3, Gemma 3: an RMS norm over each query and key head before rotary
    rotary_dim: int = 0          # rotated dims of a head (partial_rotary_factor); 0: the whole head
    attention_scale: float = 0.0  # softmax scale; 0: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    hidden_act: str = "silu"     # the gated MLP's activation: SwiGLU, or GeGLU (tanh-approximated GELU)
    final_logit_softcap: float | None = None   # logits = cap * tanh(logits / cap)
    # Per layer FULL_ATTENTION or SLIDING_ATTENTION; empty means every layer full.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None   # a sliding layer attends to the last W positions, its own included
    sliding_rope_theta: float | None = None   # plain-rotary base of sliding layers, if not rope_theta (Gemma 3)
    # Mixture of experts: num_experts > 0 makes every layer but dense_layers a routed-expert MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = True     # top-k weights rescaled to sum to 1 (Mixtral; Qwen3-MoE norm_topk_prob)
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            setattr(self, name, _positive_int(name, getattr(self, name)))
        for name in ("rope_theta", "rms_norm_eps"):
            setattr(self, name, _positive_number(name, getattr(self, name)))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        self.rotary_dim = self.rotary_dim or self.head_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary dims {self.rotary_dim} must be even and at most head_dim {self.head_dim}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"model config: hidden activation {self.hidden_act!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        self._check_layers()
        self._check_experts()

    def _check_layers(self) -> None:
        self.layer_types = tuple(self.layer_types) or (FULL_ATTENTION,) * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"model config: layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_layers} layers")
        unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ValueError(f"model config: unsupported layer types {sorted(unknown)} "
                             f"(supported: {FULL_ATTENTION}, {SLIDING_ATTENTION})")
        if SLIDING_ATTENTION in self.layer_types:
            self.sliding_window = _positive_int("sliding_window", self.sliding_window)
        if self.sliding_rope_theta is not None:
            self.sliding_rope_theta = _positive_number("sliding_rope_theta", self.sliding_rope_theta)

    def _check_experts(self) -> None:
        if not self.num_experts:
            return
        self.num_experts = _positive_int("num_experts", self.num_experts)
        self.moe_intermediate_size = _positive_int("moe_intermediate_size", self.moe_intermediate_size)
        top_k = _positive_int("num_experts_per_tok", self.num_experts_per_tok)
        if top_k > self.num_experts:
            raise ValueError(f"model config: num_experts_per_tok {top_k} exceeds num_experts {self.num_experts}")
        self.num_experts_per_tok = top_k
        self.dense_layers = tuple(self.dense_layers)
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ValueError(f"model config: dense layers {list(self.dense_layers)} outside 0..{self.num_layers - 1}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING_ATTENTION

    def window(self, layer: int) -> int | None:
        """The layer's sliding window, or None for full causal attention."""
        return self.sliding_window if self.is_sliding(layer) else None

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers


def _positive_int(name: str, value) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
    return int(value)


def _positive_number(name: str, value) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"model config: {name} must be a positive number, got {value!r}")
    return float(value)

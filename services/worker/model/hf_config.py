"""A Hugging Face config.json -> ModelConfig, one reader per model type; torch-free.

transformers 4.x and 5.x write the rotary settings differently, and checkpoints in the wild have
both layouts: 4.x has top-level `rope_theta` and `rope_scaling` ({"rope_type" or "type", ...}),
Gemma 3 adds `rope_local_base_freq`, Phi-3 `partial_rotary_factor` and
`original_max_position_embeddings`; 5.x folds them into `rope_parameters` ({"rope_type",
"rope_theta", ...}), nested by layer type where layers differ ({"full_attention": {...},
"sliding_attention": {...}}). Reading only one layout loads the other with the wrong rotary
base and scaling, and the model then silently generates different tokens: `_rope` reads both.

Which layers slide follows transformers per family: Mistral, Mixtral, Phi-3 and Qwen3-MoE give
every layer the window when `sliding_window` is set; Qwen2/Qwen3 only with
`use_sliding_window`, from `max_window_layers` on (or by `layer_types`); Gemma 3 by
`layer_types` (or every sixth layer full, `sliding_window_pattern`).
"""

from __future__ import annotations

from collections.abc import Callable

from services.worker.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig

ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")
_ROPE_ALIASES = {"su": "longrope"}     # early Phi-3 checkpoints
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


class HFConfigError(ValueError):
    """config.json says something we cannot serve; the message names the field."""


class _Reader:
    """config.json's fields, with the errors naming them."""

    def __init__(self, hf: dict):
        self.hf = hf

    def get(self, key: str, default=None):
        value = self.hf.get(key)
        return default if value is None else value

    def require(self, key: str):
        if self.hf.get(key) is None:
            raise HFConfigError(f"lacks {key!r}")
        return self.hf[key]

    def refuse(self, key: str, why: str) -> None:
        if self.hf.get(key):
            raise HFConfigError(f"{key} = {self.hf[key]!r} is not supported ({why})")


def model_config_from_hf(name: str, hf: dict, bos_token_id: int | None = None,
                         eos_token_ids: list[int] | None = None) -> ModelConfig:
    """Raises HFConfigError (a ValueError) naming the config.json field it cannot use."""
    model_type = hf.get("model_type")
    if model_type == "gemma3" and isinstance(hf.get("text_config"), dict):
        # Gemma 3's multimodal checkpoints (gemma-3-4b and up): served as their text model.
        hf = {"tie_word_embeddings": hf.get("tie_word_embeddings", True), **hf["text_config"],
              "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    if model_type not in READERS:
        raise HFConfigError(f"model_type {model_type!r} is not supported "
                            f"(supported: {', '.join(READERS)}, gemma3)")
    r = _Reader(hf)
    try:
        fields = _common(r)
        fields.update(READERS[model_type](r, fields))
        return ModelConfig(name=name, bos_token_id=bos_token_id, eos_token_ids=list(eos_token_ids or []), **fields)
    except (TypeError, ZeroDivisionError, AttributeError) as e:
        raise HFConfigError(f"a value has of the wrong type: {e}") from e


def _common(r: _Reader) -> dict:
    num_heads = r.require("num_attention_heads")
    hidden_size = r.require("hidden_size")
    head_dim = r.get("head_dim") or hidden_size // num_heads
    act = r.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"hidden_act {act!r} is not supported for this model type (silu)")
    r.refuse("mlp_bias", "the MLP has no biases")
    fields = dict(
        architecture="llama",
        vocab_size=r.require("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=r.require("intermediate_size"),
        num_layers=r.require("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=r.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=r.get("rms_norm_eps", 1e-6),
        max_context_length=r.require("max_position_embeddings"),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
    )
    params = r.hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(FULL_ATTENTION), dict):
        params = params[FULL_ATTENTION]     # nested by layer type: the family reads the others
    scaling = r.get("rope_scaling")
    if isinstance(params, dict) and isinstance(scaling, dict) and scaling:
        # A 4.x rope_scaling beside 5.x's rope_parameters: transformers 5 lets rope_scaling win.
        params = {"rope_theta": r.get("rope_theta", params.get("rope_theta", 10000.0)), **scaling}
    return fields | _rope(r, params, head_dim)


# --- rotary -------------------------------------------------------------------------------------

def _rope(r: _Reader, params: dict | None, head_dim: int) -> dict:
    """rope_theta, rope_scaling and rotary_dim (and max_context_length where scaling extends it)
    from a flat 5.x `rope_parameters` dict, or from the 4.x top-level keys when params is None."""
    if params is None:
        theta = r.get("rope_theta", 10000.0)
        scaling = r.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise HFConfigError(f"rope_scaling must be an object, got {scaling!r}")
        scaling = dict(scaling)
        partial = r.get("partial_rotary_factor", 1.0)
    elif isinstance(params, dict):
        scaling = dict(params)
        theta = scaling.pop("rope_theta", r.get("rope_theta", 10000.0))
        partial = scaling.pop("partial_rotary_factor", r.get("partial_rotary_factor", 1.0))
    else:
        raise HFConfigError(f"rope_parameters must be an object, got {params!r}")
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise HFConfigError(f"partial_rotary_factor must be in (0, 1], got {partial!r}")
    out = {"rope_theta": theta, "rotary_dim": int(head_dim * partial), "rope_scaling": _scaling(r, scaling)}
    extended = _extended_context(r, out["rope_scaling"])
    if extended:
        out["max_context_length"] = extended
    return out


def _scaling(r: _Reader, scaling: dict) -> dict | None:
    """The scaling dict with its type under "rope_type" and the defaults transformers fills in."""
    rope_type, legacy = scaling.pop("rope_type", None), scaling.pop("type", None)
    rope_type = _ROPE_ALIASES.get(rope_type or legacy, rope_type or legacy or "default")
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise HFConfigError(f"unsupported rope_scaling type {rope_type!r} "
                            f"(supported: default, {', '.join(ROPE_TYPES)})")
    max_pos = r.get("max_position_embeddings")
    if rope_type == "dynamic":
        # transformers' dynamic NTK keeps the plain base up to max_position_embeddings.
        scaling["original_max_position_embeddings"] = max_pos
    elif rope_type in ("llama3", "yarn", "longrope"):
        # Phi-3 keeps the pretraining length at the top level, and it wins there.
        original = r.get("original_max_position_embeddings") if rope_type == "longrope" else None
        scaling["original_max_position_embeddings"] = (
            original or scaling.get("original_max_position_embeddings") or max_pos)
        if rope_type in ("yarn", "longrope") and scaling.get("factor") is None and max_pos:
            scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
    return {"rope_type": rope_type, **scaling}


def _extended_context(r: _Reader, scaling: dict | None) -> int | None:
    """Dynamic NTK and YaRN exist to run past the pretraining length: allow original x factor."""
    if not scaling or scaling["rope_type"] not in ("dynamic", "yarn"):
        return None
    try:
        extended = int(scaling["original_max_position_embeddings"] * scaling["factor"])
    except (KeyError, TypeError) as e:
        raise HFConfigError(f"rope_scaling {scaling['rope_type']!r} needs numbers "
                            f"factor and original_max_position_embeddings; got {scaling}") from e
    return max(extended, r.get("max_position_embeddings"))


def _layer_rope(r: _Reader, layer_type: str, theta_key: str, default_theta: float, head_dim: int) -> dict:
    """Rotary of one layer type of a model whose layer types differ (Gemma 3): 5.x nests it under
    rope_parameters[layer_type]; 4.x has rope_theta + rope_scaling for the full layers and
    theta_key alone for the others."""
    params = r.hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        return _rope(r, {"rope_theta": default_theta, **params[layer_type]}, head_dim)
    theta = {"rope_theta": r.get(theta_key, default_theta)}
    return _rope(r, theta | (r.get("rope_scaling") or {}) if layer_type == FULL_ATTENTION else theta, head_dim)


# --- families -----------------------------------------------------------------------------------

def _all_sliding(fields: dict, window) -> dict:
    if window is None:
        return {}
    return {"sliding_window": window, "layer_types": (SLIDING_ATTENTION,) * fields["num_layers"]}


def _llama(r: _Reader, fields: dict) -> dict:
    bias = bool(r.get("attention_bias", False))
    return {"qkv_bias": bias, "o_proj_bias": bias}


def _qwen2_layers(r: _Reader, fields: dict) -> dict:
    window = r.get("sliding_window") if r.get("use_sliding_window", False) else None
    if window is None:
        return {}
    layer_types = r.get("layer_types") or [
        SLIDING_ATTENTION if i >= r.get("max_window_layers", 0) else FULL_ATTENTION
        for i in range(fields["num_layers"])]
    return {"sliding_window": window, "layer_types": tuple(layer_types)}


def _qwen2(r: _Reader, fields: dict) -> dict:
    return {"qkv_bias": True, **_qwen2_layers(r, fields)}


def _qwen3(r: _Reader, fields: dict) -> dict:
    return {**_llama(r, fields), "architecture": "qwen3", "qk_norm": True, **_qwen2_layers(r, fields)}


def _mistral(r: _Reader, fields: dict) -> dict:
    return {"architecture": "mistral", **_all_sliding(fields, r.get("sliding_window"))}


def _phi3(r: _Reader, fields: dict) -> dict:
    """Fused qkv_proj and gate_up_proj in the checkpoint, longrope scaling, partial rotary."""
    return {"architecture": "phi3", "rms_norm_eps": r.get("rms_norm_eps", 1e-5),
            **_all_sliding(fields, r.get("sliding_window"))}


def _gemma3_text(r: _Reader, fields: dict) -> dict:
    r.refuse("attn_logit_softcapping", "attention kernels apply no logit soft-capping")
    r.refuse("use_bidirectional_attention", "a decoder attends causally")
    act = r.get("hidden_activation") or r.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise HFConfigError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    head_dim = r.get("head_dim", 256)
    num_layers = fields["num_layers"]
    pattern = r.get("sliding_window_pattern") or r.get("_sliding_window_pattern") or 6
    layer_types = tuple(r.get("layer_types") or [
        SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)])
    full = _layer_rope(r, FULL_ATTENTION, "rope_theta", 1_000_000.0, head_dim)
    sliding = _layer_rope(r, SLIDING_ATTENTION, "rope_local_base_freq", 10_000.0, head_dim)
    if sliding["rope_scaling"] is not None or sliding["rotary_dim"] != full["rotary_dim"]:
        raise HFConfigError("scaled or partial rotary on sliding layers is not supported")
    return {
        "architecture": "gemma3_text", "head_dim": head_dim, "hidden_act": "gelu_tanh", "qk_norm": True,
        "qkv_bias": bool(r.get("attention_bias", False)), "o_proj_bias": bool(r.get("attention_bias", False)),
        "tie_word_embeddings": bool(r.get("tie_word_embeddings", True)),
        "attention_scale": float(r.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        "final_logit_softcap": r.get("final_logit_softcapping"),
        "layer_types": layer_types, "sliding_window": r.get("sliding_window"),
        **full, "sliding_rope_theta": sliding["rope_theta"],
    }


def _qwen3_moe(r: _Reader, fields: dict) -> dict:
    num_experts = r.require("num_experts" if "num_experts" in r.hf else "num_local_experts")   # 4.x, 5.x
    sparse_step = r.get("decoder_sparse_step", 1)
    only_dense = set(r.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(fields["num_layers"]) if i in only_dense or (i + 1) % sparse_step)
    window = r.get("sliding_window") if r.get("use_sliding_window", False) else None
    return {**_llama(r, fields), "architecture": "qwen3_moe", "qk_norm": True, "num_experts": num_experts,
            "num_experts_per_tok": r.require("num_experts_per_tok"),
            "moe_intermediate_size": r.require("moe_intermediate_size"),
            "moe_renormalize": bool(r.get("norm_topk_prob", False)), "dense_layers": dense,
            **_all_sliding(fields, window)}


def _mixtral(r: _Reader, fields: dict) -> dict:
    return {"architecture": "mixtral", "rms_norm_eps": r.get("rms_norm_eps", 1e-5),
            "num_experts": r.require("num_local_experts"), "num_experts_per_tok": r.require("num_experts_per_tok"),
            "moe_intermediate_size": fields["intermediate_size"], "moe_renormalize": True,
            **_all_sliding(fields, r.get("sliding_window"))}


READERS: dict[str, Callable[[_Reader, dict], dict]] = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "mistral": _mistral, "phi3": _phi3,
    "gemma3_text": _gemma3_text, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral,
}

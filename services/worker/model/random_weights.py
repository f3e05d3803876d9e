"""Seeded random weights at the shape of a known model, for benchmarks and tests without a checkpoint.

The tokenizer is SmolLM2's whatever the shape: ids the model emits beyond its vocabulary decode to
nothing. Weights are drawn on the target device from a generator seeded with `seed`, so the same
seed, shape, dtype and device give the same model.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from services.worker.model.config import ModelConfig
from services.worker.model.llama import LlamaModel

INIT_STD = 0.02   # the usual Llama initializer_range

_SHAPES = {
    "tiny": ModelConfig(name="tiny", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                        max_context_length=2048, tie_word_embeddings=True, bos_token_id=None),
    "smollm2-135m": ModelConfig(name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                                rms_norm_eps=1e-5, max_context_length=8192, tie_word_embeddings=True,
                                bos_token_id=None),
    "llama-3-8b": ModelConfig(name="llama-3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                              rms_norm_eps=1e-5, max_context_length=8192, tie_word_embeddings=False,
                              bos_token_id=None),
    "llama-3.1-8b": ModelConfig(name="llama-3.1-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                                rms_norm_eps=1e-5, max_context_length=131072, tie_word_embeddings=False,
                                bos_token_id=None,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3-70b": ModelConfig(name="llama-3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                               num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                               rms_norm_eps=1e-5, max_context_length=8192, tie_word_embeddings=False,
                               bos_token_id=None),
    "qwen2.5-7b": ModelConfig(name="qwen2.5-7b", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1000000.0,
                              rms_norm_eps=1e-6, max_context_length=32768, tie_word_embeddings=False,
                              bos_token_id=None, qkv_bias=True),
}

SHAPE_NAMES = tuple(_SHAPES)


def random_config(shape: str, bos_token_id: int | None, eos_token_ids: list[int]) -> ModelConfig:
    """The named shape, with the stop tokens of the tokenizer that will serve it."""
    if shape not in _SHAPES:
        raise ValueError(f"unknown random model shape {shape!r} (known: {', '.join(SHAPE_NAMES)})")
    return replace(_SHAPES[shape], name=f"random:{shape}", bos_token_id=bos_token_id,
                   eos_token_ids=list(eos_token_ids))


@torch.no_grad()
def init_random(model: LlamaModel, seed: int) -> None:
    """Norm weights 1, biases 0, everything else N(0, INIT_STD), in named_parameters order; a tied
    head is then set to the embedding."""
    params = list(model.named_parameters())
    if not params or params[0][1].device.type == "meta":
        return
    generator = torch.Generator(device=params[0][1].device).manual_seed(seed)
    for name, param in params:
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, INIT_STD, generator=generator)
    if model.config.tie_word_embeddings:
        model.lm_head.weight_t.copy_(model.embed_tokens.weight.t())

"""Seeded random weights at the shape of a known model, for benchmarks and tests without a checkpoint.

The tokenizer is SmolLM2's whatever the shape: ids the model emits beyond its vocabulary decode to
nothing. Weights are drawn on the target device from a generator seeded with `seed`, so the same
seed, shape, dtype and device give the same model.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from services.worker.model.config import ModelConfig
from services.worker.model.decoder import CausalLM
from services.worker.model.layers import RMSNorm
from services.worker.model.shapes import NAMED_SHAPES

INIT_STD = 0.02   # the usual Llama initializer_range

SHAPE_NAMES = tuple(NAMED_SHAPES)


def random_config(shape: str, bos_token_id: int | None, eos_token_ids: list[int]) -> ModelConfig:
    """The named shape, with the stop tokens of the tokenizer that will serve it."""
    if shape not in NAMED_SHAPES:
        raise ValueError(f"unknown random model shape {shape!r} (known: {', '.join(SHAPE_NAMES)})")
    return replace(NAMED_SHAPES[shape], name=f"random:{shape}", bos_token_id=bos_token_id,
                   eos_token_ids=list(eos_token_ids))


@torch.no_grad()
def init_random(model: CausalLM, seed: int) -> None:
    """Norm weights at their identity (1, or 0 for Gemma's 1 + weight), biases 0, everything else
    (experts included) N(0, INIT_STD), in named_parameters order; a tied head is then set to the embedding."""
    params = list(model.named_parameters())
    if not params or params[0][1].device.type == "meta":
        return
    norms = {f"{name}.weight": m.unit_weight for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    generator = torch.Generator(device=params[0][1].device).manual_seed(seed)
    for name, param in params:
        if name in norms:
            param.fill_(norms[name])
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, INIT_STD, generator=generator)
    if model.config.tie_word_embeddings:
        model.lm_head.weight_t.copy_(model.embed_tokens.weight.t())

"""What every weight loader produces, whatever the file format."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from services.worker.model.config import ModelConfig
from services.worker.model.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    config: ModelConfig
    tokenizer: Tokenizer
    # Hugging Face-named tensors (model.layers.N.self_attn.q_proj.weight, ...), read lazily;
    # None for random weights.
    weights: Iterable[tuple[str, torch.Tensor]] | None

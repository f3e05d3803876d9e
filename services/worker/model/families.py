"""Which model class builds each architecture (ModelConfig.architecture)."""

from __future__ import annotations

import torch

from services.worker.attention.backend import AttentionBackend
from services.worker.model.config import ModelConfig
from services.worker.model.decoder import CausalLM
from services.worker.model.gemma3 import Gemma3Model
from services.worker.model.llama import LlamaModel
from services.worker.model.moe import MixtralModel, Qwen3MoeModel

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaModel, "qwen3": LlamaModel, "mistral": LlamaModel, "phi3": LlamaModel,
    "gemma3_text": Gemma3Model, "qwen3_moe": Qwen3MoeModel, "mixtral": MixtralModel,
}


def build_model(config: ModelConfig, attention: AttentionBackend, dtype: torch.dtype,
                device: torch.device) -> CausalLM:
    """Parameters uninitialised: load_weights or random init fills them."""
    if config.architecture not in MODEL_CLASSES:
        raise ValueError(f"architecture {config.architecture!r} is not supported "
                         f"(supported: {', '.join(MODEL_CLASSES)})")
    return MODEL_CLASSES[config.architecture](config, attention, dtype, device)

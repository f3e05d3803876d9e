"""Which model class builds each architecture (ModelConfig.architecture)."""

from __future__ import annotations

import torch

from services.worker.attention.backend import AttentionBackend
from services.worker.model.config import ModelConfig
from services.worker.model.decoder import CausalLM
from services.worker.model.gemma3 import Gemma3Model
from services.worker.model.llama import LlamaModel
from services.worker.model.moe import MixtralModel, Qwen3MoeModel
from services.worker.parallel.group import SINGLE, TensorParallel

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaModel, "qwen3": LlamaModel, "mistral": LlamaModel, "phi3": LlamaModel,
    "gemma3_text": Gemma3Model, "qwen3_moe": Qwen3MoeModel, "mixtral": MixtralModel,
}


def build_model(config: ModelConfig, attention: AttentionBackend, dtype: torch.dtype,
                device: torch.device, tp: TensorParallel = SINGLE) -> CausalLM:
    """Parameters uninitialised (this rank's shard in a group): load_weights or random init fills them."""
    if config.architecture not in MODEL_CLASSES:
        raise ValueError(f"architecture {config.architecture!r} is not supported "
                         f"(supported: {', '.join(MODEL_CLASSES)})")
    return MODEL_CLASSES[config.architecture](config, attention, dtype, device, tp)

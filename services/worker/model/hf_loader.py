"""Reads a Hugging Face checkpoint folder: config.json, *.safetensors (sharded or not), tokenizer.json,
tokenizer_config.json (chat template, special tokens), generation_config.json (extra stop ids)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import tokenizers
import torch
from safetensors import SafetensorError, safe_open

from services.worker.model.checkpoint import Checkpoint
from services.worker.model.config import ModelConfig
from services.worker.model.tokenizer import Tokenizer

_SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def load_hf_folder(folder: str | Path) -> Checkpoint:
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"model folder {str(folder)!r} does not exist")
    hf = _read_json(folder / "config.json", required=True)
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    generation_config = _read_json(folder / "generation_config.json")
    tokenizer = _tokenizer(folder, hf, tokenizer_config, generation_config)
    config = _model_config(folder.name, hf, tokenizer)
    return Checkpoint(config=config, tokenizer=tokenizer, weights=_weights(_safetensors_files(folder)))


def _read_json(path: Path, required: bool = False) -> dict:
    if not path.is_file():
        if required:
            raise ValueError(f"model folder lacks {path.name} ({path})")
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt {path.name} ({path}): {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"corrupt {path.name} ({path}): expected a JSON object")
    return data


def _model_config(name: str, hf: dict, tokenizer: Tokenizer) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {_SUPPORTED_MODEL_TYPES})")
    if hf.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias is not supported")

    def require(key: str):
        if key not in hf:
            raise ValueError(f"config.json lacks {key!r}")
        return hf[key]

    num_heads = require("num_attention_heads")
    hidden_size = require("hidden_size")
    attention_bias = bool(hf.get("attention_bias", False))
    try:
        return ModelConfig(
            name=name,
            vocab_size=require("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=require("intermediate_size"),
            num_layers=require("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden_size // num_heads,
            rope_theta=hf.get("rope_theta", 10000.0),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_context_length=require("max_position_embeddings"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
            rope_scaling=_rope_scaling(hf.get("rope_scaling")),
            qkv_bias=model_type == "qwen2" or attention_bias,   # Qwen2 always has q/k/v biases
            o_proj_bias=model_type == "llama" and attention_bias,
        )
    except (TypeError, ZeroDivisionError) as e:
        raise ValueError(f"config.json has a value of the wrong type: {e}") from e


def _rope_scaling(scaling: dict | None) -> dict | None:
    if not scaling or scaling.get("rope_type", scaling.get("type")) == "default":
        return None
    return scaling


def _tokenizer(folder: Path, hf: dict, tokenizer_config: dict, generation_config: dict) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"model folder lacks tokenizer.json ({path})")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"corrupt tokenizer.json ({path}): {e}") from e

    def token_id(key: str) -> int | None:
        token = tokenizer_config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return backend.token_to_id(token) if token else None

    bos = hf.get("bos_token_id", token_id("bos_token"))
    eos: list[int] = []
    # tokenizer_config's eos first: chat templates see it as eos_token, as in transformers.
    for source in (token_id("eos_token"), hf.get("eos_token_id"), generation_config.get("eos_token_id")):
        eos += source if isinstance(source, list) else [source] if source is not None else []
    return Tokenizer(backend, bos_token_id=bos, eos_token_ids=list(dict.fromkeys(eos)),
                     chat_template=_chat_template(folder, tokenizer_config))


def _chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    """transformers keeps it in chat_template.jinja (newer) or tokenizer_config.json (a string or named list)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(folder)!r} has no *.safetensors weights")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"model folder {str(folder)!r} lacks weight shards {missing}")
    return files


def _weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (OSError, SafetensorError) as e:
            raise ValueError(f"corrupt weights file {file}: {e}") from e

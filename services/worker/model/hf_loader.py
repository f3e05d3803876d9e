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
from services.worker.model.hf_config import model_config_from_hf
from services.worker.model.tokenizer import Tokenizer


def load_hf_folder(folder: str | Path) -> Checkpoint:
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"model folder {str(folder)!r} does not exist")
    hf = _read_json(folder / "config.json", required=True)
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    generation_config = _read_json(folder / "generation_config.json")
    tokenizer = _tokenizer(folder, hf, tokenizer_config, generation_config)
    try:
        config = model_config_from_hf(folder.name, hf, tokenizer.bos_token_id, tokenizer.eos_token_ids)
    except ValueError as e:
        raise ValueError(f"{folder / 'config.json'}: {e}") from e
    return Checkpoint(config=config, tokenizer=tokenizer, weights=SafetensorsWeights(folder))


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


class SafetensorsWeights:
    """The folder's tensors, read lazily file by file (sharded or not). `location` names the file
    being read while iterating, and the folder before and after, for errors about a tensor."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files = _safetensors_files(folder)
        self.location = str(folder)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            self.location = str(file)
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except (OSError, SafetensorError) as e:
                raise ValueError(f"corrupt weights file {file}: {e}") from e
        self.location = str(self.folder)


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

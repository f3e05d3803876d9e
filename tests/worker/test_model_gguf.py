"""GGUF files written here from a tiny transformers model, the way llama.cpp's converter writes them
(Q/K rows permuted for its rotary, separate output head, float16 tensors), load back to the same logits;
GGUF files we cannot serve are refused with a clear ValueError."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from services.worker.attention.torch_paged import TorchPagedAttention
from services.worker.model.gguf_file import GGUFFile
from services.worker.model.loader import load_model
from tests.worker.test_model_hf_folder import COMMON, save_tiny_checkpoint

_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _gguf_name(hf_name: str) -> str:
    if hf_name == "lm_head.weight":
        return "output.weight"
    name = hf_name.removeprefix("model.")
    if name.startswith("layers."):
        _, layer, rest = name.split(".", 2)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_NAMES[module]}.{kind}"
    return {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}[name]


def write_gguf(path, model, tokenizer_metadata: dict, arch: str = "llama", drop: tuple[str, ...] = (),
               **overrides) -> None:
    writer = GGUFWriter(str(path), arch)
    meta = {f"{arch}.block_count": COMMON["num_hidden_layers"], f"{arch}.context_length": COMMON["max_position_embeddings"],
            f"{arch}.embedding_length": COMMON["hidden_size"], f"{arch}.feed_forward_length": COMMON["intermediate_size"],
            f"{arch}.attention.head_count": COMMON["num_attention_heads"],
            f"{arch}.attention.head_count_kv": COMMON["num_key_value_heads"], f"{arch}.rope.freq_base": 10000.0,
            f"{arch}.attention.layer_norm_rms_epsilon": COMMON["rms_norm_eps"], **tokenizer_metadata, **overrides}
    for key, value in meta.items():
        if key not in drop:
            _add(writer, key, value)
    for name, tensor in model.state_dict().items():
        array = tensor.numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = COMMON["num_attention_heads"] if "q_proj" in name else COMMON["num_key_value_heads"]
            array = _llama_cpp_permute(array, heads)
        writer.add_tensor(_gguf_name(name), array.astype(np.float16 if array.ndim == 2 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer: GGUFWriter, key: str, value) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_array(key, value)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_tokenizer):
    """The tiny transformers Llama, its matrices rounded to float16 as the GGUF will hold them."""
    model = save_tiny_checkpoint(tmp_path_factory.mktemp("hf"), "llama", smollm2_tokenizer)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.copy_(param.half())
    return model


@pytest.fixture(scope="module")
def tokenizer_metadata(smollm2_gguf_path) -> dict:
    return {k: v for k, v in GGUFFile(smollm2_gguf_path).metadata.items() if k.startswith("tokenizer.")}


def test_llama_cpp_style_gguf_matches_transformers(tmp_path, tiny_llama, tokenizer_metadata, paged_sequence):
    write_gguf(tmp_path / "tiny.gguf", tiny_llama, tokenizer_metadata)
    loaded = load_model(str(tmp_path / "tiny.gguf"), torch.float32, torch.device("cpu"), TorchPagedAttention())
    assert not loaded.config.tie_word_embeddings
    ids = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hi 🌍"}]))
    with torch.no_grad():
        reference = tiny_llama(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(paged_sequence(loaded.model).step(ids), reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("change, message", [
    (dict(arch="gpt2"), "GGUF architecture 'gpt2' is not supported"),
    (dict(**{"tokenizer.ggml.pre": "llama-bpe"}), "GGUF pre-tokenizer 'llama-bpe' is not supported"),
    (dict(**{"tokenizer.ggml.model": "llama"}), "GGUF tokenizer 'llama' is not supported"),
    (dict(drop=("llama.block_count",)), "GGUF metadata lacks 'llama.block_count'"),
])
def test_unsupported_gguf_files(tmp_path, tiny_llama, tokenizer_metadata, change, message):
    write_gguf(tmp_path / "odd.gguf", tiny_llama, tokenizer_metadata, **change)
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path / "odd.gguf"), torch.float32, torch.device("cpu"), TorchPagedAttention())

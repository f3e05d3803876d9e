"""Hugging Face checkpoint folders: tiny random transformers models saved with save_pretrained, loaded
by our loader, must give transformers' logits (float32: to rounding; bfloat16: to bf16 precision)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.worker.attention.torch_paged import TorchPagedAttention
from services.worker.model.loader import load_model

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
              bos_token_id=1, eos_token_id=2)
VARIANTS = {
    # GQA, separate head, one safetensors file.
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=10000.0), None),
    # Llama 3.1 rope scaling, q/k/v/o biases, head_dim != hidden/heads, sharded weights.
    "llama3-scaled-bias-sharded": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, rope_theta=500000.0, attention_bias=True, head_dim=32,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}), "2MB"),
    # Qwen2: q/k/v biases (no o bias), tied head.
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0), None),
}


def save_tiny_checkpoint(folder: Path, variant: str, tokenizer) -> torch.nn.Module:
    """A seeded random transformers model and SmolLM2's tokenizer files in `folder`; -> the model (float32, eval)."""
    import transformers
    config_cls, model_cls, extra, shard = VARIANTS[variant]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra)).eval()
    model.save_pretrained(folder, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory, smollm2_tokenizer):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save_tiny_checkpoint(folder, request.param, smollm2_tokenizer)


def _prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tiny models say random things, like 🎲 and 数字 42."}]))


def test_float32_logits_match_transformers(tiny, paged_sequence):
    variant, folder, reference = tiny
    loaded = load_model(str(folder), torch.float32, torch.device("cpu"), TorchPagedAttention())
    if variant.startswith("llama3"):
        assert list(folder.glob("*.safetensors.index.json")) and len(list(folder.glob("*.safetensors"))) > 1
        assert loaded.config.rope_scaling["rope_type"] == "llama3" and loaded.config.o_proj_bias
    assert loaded.config.qkv_bias == (variant != "llama")
    assert loaded.config.tie_word_embeddings == (variant == "qwen2-tied")
    assert loaded.config.eos_token_ids == [2, 0] and loaded.config.bos_token_id == 1
    ids = _prompt_ids(loaded.tokenizer)
    ours = paged_sequence(loaded.model).step(ids)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    assert expected.abs().max() > 1.0  # weights large enough that a wrong layer would show
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_bfloat16_logits_close_to_transformers(tiny, paged_sequence):
    _, folder, reference = tiny
    loaded = load_model(str(folder), torch.bfloat16, torch.device("cpu"), TorchPagedAttention())
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    ids = _prompt_ids(loaded.tokenizer)
    ours = paged_sequence(loaded.model).step(ids)
    assert ours.dtype == torch.float32
    with torch.no_grad():
        expected = reference.to(torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    reference.float()
    scale = expected.abs().max()
    assert (ours - expected).abs().max() < 0.025 * scale  # measured about 0.011 * scale

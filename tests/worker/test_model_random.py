"""random:<shape> models: seeded and deterministic, at the named shapes (big ones checked on the meta device)."""

from __future__ import annotations

import pytest
import torch

from services.worker.attention.torch_paged import TorchPagedAttention
from services.worker.model.loader import load_model
from services.worker.model.random_weights import SHAPE_NAMES
from services.worker.model.rotary import RotaryEmbedding

CPU = torch.device("cpu")


def _load(source: str, seed: int = 0, device=CPU, dtype=torch.float32):
    return load_model(source, dtype, device, TorchPagedAttention(), seed=seed)


def test_tiny_is_seeded_and_runs(paged_sequence):
    a, b, c = _load("random:tiny", seed=7), _load("random:tiny", seed=7), _load("random:tiny", seed=8)
    for (name, pa), pb, pc in zip(a.model.named_parameters(), b.model.parameters(), c.model.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    assert torch.equal(a.model.lm_head.weight_t, a.model.embed_tokens.weight.t())   # tiny is tied
    ids = a.tokenizer.encode("random weights, real tokenizer")
    logits = paged_sequence(a.model).step(ids)
    assert logits.shape == (len(ids), a.config.vocab_size) and torch.isfinite(logits).all()
    torch.testing.assert_close(logits, paged_sequence(b.model).step(ids), atol=0, rtol=0)
    assert a.config.eos_token_ids == a.tokenizer.eos_token_ids == [2]


@pytest.mark.parametrize("shape, params_billion, qkv_rows", [
    ("smollm2-135m", 0.1345, 960), ("llama-3-8b", 8.030, 6144), ("llama-3.1-8b", 8.030, 6144),
    ("llama-3-70b", 70.55, 10240), ("qwen2.5-7b", 7.616, 4608), ("qwen3-8b", 8.191, 6144),
    ("qwen3-30b-a3b", 30.53, 5120), ("mixtral-8x7b", 46.70, 6144), ("gemma-3-12b", 11.77, 8192)])
def test_named_shapes_on_meta_device(shape, params_billion, qkv_rows):
    loaded = _load(f"random:{shape}", device=torch.device("meta"), dtype=torch.bfloat16)
    params = dict(loaded.model.named_parameters())
    tied_copy = params["lm_head.weight_t"].numel() if loaded.config.tie_word_embeddings else 0
    assert (sum(p.numel() for p in params.values()) - tied_copy) / 1e9 == pytest.approx(params_billion, rel=2e-3)
    assert params["layers.0.self_attn.qkv_proj.weight_t"].shape == (loaded.config.hidden_size, qkv_rows)
    assert ("layers.0.self_attn.qkv_proj.bias" in params) == (shape == "qwen2.5-7b")
    assert len(loaded.model.layers) == loaded.config.num_layers
    assert shape in SHAPE_NAMES and loaded.config.name == f"random:{shape}"


def test_llama31_rope_scaling_slows_low_frequencies_only():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    plain = RotaryEmbedding(128, 4, 500000.0, None, CPU)
    scaled = RotaryEmbedding(128, 4, 500000.0, scaling, CPU)
    angle_plain, angle_scaled = plain.sin[1].asin(), scaled.sin[1].asin()    # position 1: the frequencies
    assert torch.equal(angle_plain[:16], angle_scaled[:16])                  # short wavelengths kept
    torch.testing.assert_close(angle_scaled[-16:], angle_plain[-16:] / 8)    # long ones slowed by factor
    assert _load("random:llama-3.1-8b", device=torch.device("meta")).model.rotary.cos.shape == (131072, 64)
    with pytest.raises(ValueError, match="unsupported rope_scaling"):
        RotaryEmbedding(128, 4, 500000.0, {"rope_type": "mrope", "factor": 4.0}, CPU)

"""Dense model families from their Hugging Face folders against transformers, token for token.

llama (with every rope scaling), qwen2, qwen3, mistral, phi3 and gemma3_text: tiny random
checkpoints built and saved by transformers 5 (tests/worker/families.py), served by our engine
under batching, chunked prefill, prefix caching and preemption (sliding-window families with
prompts longer than the window), read again from a config.json in transformers 4.x's layout, and
Gemma 3 served by a real worker process over gRPC.
"""

from __future__ import annotations

import pytest

from tests.worker.families import (COMMON, WINDOW, assert_matches, build_family, check_4x_layout, check_engine,
                                   check_worker, engine_outputs, load, prompts, reference_greedy, save_checkpoint)

SLIDING, FULL = "sliding_attention", "full_attention"
ORIGINAL = 48   # pretraining length of the length-dependent scalings: prompts fit, decoding runs past it


def _longrope(rotary_dim: int) -> dict:
    half = rotary_dim // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.5 + 0.5 * i for i in range(half)]}


CASES = {
    "llama": ("llama", dict(attention_bias=True, head_dim=32)),
    "llama-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})),
    "llama-dynamic": ("llama", dict(max_position_embeddings=ORIGINAL,
                                    rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})),
    "llama-yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                  "original_max_position_embeddings": 64})),
    "llama-llama3": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 5e5,
        "original_max_position_embeddings": 32})),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "phi3": ("phi3", dict(sliding_window=WINDOW, original_max_position_embeddings=ORIGINAL,
                          rope_parameters={**_longrope(8), "rope_theta": 1e4, "partial_rotary_factor": 0.5})),
    "gemma3_text": ("gemma3_text", dict(
        head_dim=16, sliding_window=WINDOW, layer_types=[SLIDING, FULL, SLIDING], num_hidden_layers=3,
        query_pre_attn_scalar=24, final_logit_softcapping=30.0, tie_word_embeddings=False,
        rope_parameters={FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         SLIDING: {"rope_type": "default", "rope_theta": 1e4}})),
}


FAMILIES = [case for case in CASES if not case.startswith("llama-")]


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory, smollm2_tokenizer):
    """-> (case, folder, transformers' greedy references per prompt)."""
    return build_family(request.param, CASES, tmp_path_factory, smollm2_tokenizer)


def test_the_config_is_read_as_written(family):
    case, folder, _ = family
    c = load(folder).config
    expected_window = {"mistral": WINDOW, "phi3": WINDOW, "gemma3_text": WINDOW}.get(case)
    assert c.sliding_window == expected_window
    if case == "gemma3_text":
        assert c.layer_types == (SLIDING, FULL, SLIDING) and c.sliding_rope_theta == 1e4 and c.rope_theta == 1e6
        assert c.attention_scale == 24 ** -0.5 and c.final_logit_softcap == 30.0 and c.hidden_act == "gelu_tanh"
    assert c.qk_norm == (case in ("qwen3", "gemma3_text"))
    assert c.rotary_dim == (8 if case == "phi3" else c.head_dim)
    rope_type = case.removeprefix("llama-") if case.startswith("llama-") else None
    rope_type = "longrope" if case == "phi3" else "linear" if case == "gemma3_text" else rope_type
    assert (c.rope_scaling or {}).get("rope_type") == rope_type
    if case == "llama-dynamic":
        assert c.max_context_length == 2 * ORIGINAL


@pytest.mark.parametrize("family", FAMILIES, indirect=True)   # the rope scalings: test_config_in_the_4x_layout
def test_engine_matches_transformers_under_every_setting(family):
    check_engine(load(family[1]), family[2])


def test_config_in_the_4x_layout_gives_the_same_model(family, tmp_path):
    check_4x_layout(*family[1:], tmp_path)


@pytest.mark.parametrize("family", ["gemma3_text"], indirect=True)
def test_gemma3_served_by_a_worker_over_grpc(family, tmp_path):
    _, folder, references = family
    check_worker(tmp_path, folder, references)


def test_a_multimodal_gemma3_checkpoint_serves_its_text_model(tmp_path, smollm2_tokenizer):
    """model_type gemma3 (gemma-3-4b and up): text_config read, language_model.* tensors loaded,
    the vision tower's and projector's left out; greedy tokens as transformers' text-only forward."""
    text = {**COMMON, **CASES["gemma3_text"][1], "model_type": "gemma3_text"}
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    model = save_checkpoint(tmp_path, smollm2_tokenizer, "gemma3", text_config=text, vision_config=vision,
                            mm_tokens_per_image=4, boi_token_index=1021, eoi_token_index=1022,
                            image_token_index=1023, tie_word_embeddings=False)
    loaded = load(tmp_path)
    assert loaded.config.architecture == "gemma3_text" and loaded.config.layer_types == (SLIDING, FULL, SLIDING)
    ours, _ = engine_outputs(loaded, prompts())
    for rid, ids in prompts().items():
        assert_matches(ours[rid], reference_greedy(model, ids), f"gemma3 multimodal {rid}")

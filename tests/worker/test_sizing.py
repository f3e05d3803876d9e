"""KV-cache sizing: the arithmetic against hand-worked figures, and clear errors for bad input."""

import json
import subprocess
import sys

import pytest

from services.worker.model.config import ModelConfig
from services.worker.sizing import (GIB, SHAPES, ModelShape, SizingError, format_plan, kv_bytes_per_token,
                                    kv_cache_report, load_shape, main, plan_kv_cache, request_kv_bytes)


def test_kv_bytes_per_token_of_known_models():
    assert kv_bytes_per_token(SHAPES["llama-2-13b"], "float16") == 2 * 40 * 5120 * 2 == 800 * 1024
    assert kv_bytes_per_token(SHAPES["llama-3-8b"], "bfloat16") == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert kv_bytes_per_token(SHAPES["llama-3-8b"], "fp8") == 64 * 1024
    assert kv_bytes_per_token(SHAPES["smollm2-135m"], "float32") == 2 * 30 * 3 * 64 * 4


def test_parameter_counts_match_the_published_sizes():
    published = {"llama-2-7b": 6.74e9, "llama-2-13b": 13.02e9, "llama-3-8b": 8.03e9,
                 "llama-3-70b": 70.55e9, "smollm2-135m": 134.5e6}
    for name, params in published.items():
        assert SHAPES[name].num_params == pytest.approx(params, rel=0.005), name


def test_plan_for_llama_2_13b_on_40_gib_by_hand():
    plan = plan_kv_cache(SHAPES["llama-2-13b"], 40, weights_dtype="float16", utilisation=0.9)
    budget = int(40 * GIB * 0.9) - SHAPES["llama-2-13b"].num_params * 2
    assert plan.kv_budget_bytes == budget
    assert plan.num_blocks == budget // (16 * 800 * 1024)
    assert plan.paged_requests == plan.num_blocks // 82            # ceil(1300 / 16) blocks each
    assert plan.contiguous_requests == budget // (4096 * 800 * 1024)
    assert plan.paged_requests > 3 * plan.contiguous_requests      # paging's whole point


def test_more_memory_and_smaller_kv_dtype_hold_more():
    shape = SHAPES["llama-3-8b"]
    small, big = plan_kv_cache(shape, 40), plan_kv_cache(shape, 80)
    assert big.num_blocks > 2 * small.num_blocks                  # the weights are paid once
    assert plan_kv_cache(shape, 80, kv_dtype="fp8").num_blocks == pytest.approx(2 * big.num_blocks, abs=1)


def test_hf_config_json(tmp_path):
    config = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = load_shape(str(tmp_path))
    assert kv_bytes_per_token(shape, "bfloat16") == 128 * 1024
    assert shape.num_params == SHAPES["llama-3-8b"].num_params
    del config["num_key_value_heads"]                               # defaults to multi-head attention
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_shape(str(tmp_path / "config.json")).num_kv_heads == 32


def test_worker_report_states_the_figures():
    line = kv_cache_report(SHAPES["llama-3-8b"], num_blocks=1000, block_size=16, kv_dtype="bfloat16",
                           request_tokens=1300)
    assert "128 KiB/token" in line and "1000 blocks x 16 tokens = 16000 tokens" in line
    assert f"{1000 // 82} paged" in line and f"{16000 // 8192} with 8192-token" in line


def test_worker_report_takes_the_engines_model_config():
    smollm2 = ModelConfig(name="smollm2-135m-instruct", vocab_size=49152, hidden_size=576,
                          intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                          rope_theta=100000.0, rms_norm_eps=1e-5, max_context_length=8192,
                          tie_word_embeddings=True, bos_token_id=1)
    line = kv_cache_report(smollm2, num_blocks=512, block_size=16, kv_dtype="float32", request_tokens=100)
    assert line.startswith("KV cache: smollm2-135m-instruct, 45 KiB/token (float32)")  # 2*30*3*64*4
    assert f"{512 // 7} paged" in line


def test_command_prints_the_13b_example():
    out = subprocess.run([sys.executable, "-m", "services.worker.sizing", "--model", "llama-2-13b",
                          "--gpu-memory", "80", "40"], capture_output=True, text=True, check=True).stdout
    assert out.count("KV per token        800 KiB") == 2
    assert "80 GiB GPU" in out and "40 GiB GPU" in out
    assert "paged" in out and "contiguous" in out


@pytest.mark.parametrize("kwargs, message", [
    ({"gpu_memory_gib": 0}, "GPU memory must be positive"),
    ({"gpu_memory_gib": 80, "utilisation": 1.5}, "utilisation"),
    ({"gpu_memory_gib": 80, "weights_dtype": "float13"}, "unknown dtype 'float13'"),
    ({"gpu_memory_gib": 80, "kv_dtype": "int4"}, "unknown dtype 'int4'"),
    ({"gpu_memory_gib": 80, "block_size": 0}, "block size"),
    ({"gpu_memory_gib": 80, "prompt_tokens": 5000}, "exceeds the 4096-token context"),
    ({"gpu_memory_gib": 80, "prompt_tokens": 0, "output_tokens": 0}, "not both 0"),
    ({"gpu_memory_gib": 24}, "no room for even one KV block"),
])
def test_bad_plan_inputs(kwargs, message):
    with pytest.raises(SizingError, match=message):
        plan_kv_cache(SHAPES["llama-2-13b"], **kwargs)


def test_bad_model_inputs(tmp_path):
    with pytest.raises(SizingError, match="neither a known model"):
        load_shape("llama-9-1t")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SizingError, match="not a readable JSON"):
        load_shape(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(SizingError, match="config.json: lacks 'num_attention_heads'"):
        load_shape(str(tmp_path))
    with pytest.raises(SizingError, match="multiple of num_kv_heads"):
        ModelShape("odd", 2, 64, 8, 3, 128, 100, 512)
    with pytest.raises(SizingError, match="positive integer"):
        ModelShape("neg", -1, 64, 8, 8, 128, 100, 512)


def test_command_rejects_bad_input_with_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "llama-3-70b", "--gpu-memory", "80"])
    assert exit_info.value.code == 2
    assert "no room for even one KV block" in capsys.readouterr().err


def test_moe_counts_every_expert_resident_and_top_k_active():
    # Published: Qwen3-30B-A3B 30.5 B (3.3 B active), Mixtral 8x7B 46.7 B (12.9 B active), Qwen3-8B 8.2 B.
    for name, total, active in [("qwen3-30b-a3b", 30.53e9, 3.35e9), ("mixtral-8x7b", 46.70e9, 12.88e9),
                                ("qwen3-8b", 8.19e9, 8.19e9)]:
        assert SHAPES[name].num_params == pytest.approx(total, rel=0.005), name
        assert SHAPES[name].active_params == pytest.approx(active, rel=0.01), name
    plan = plan_kv_cache(SHAPES["qwen3-30b-a3b"], 80)
    assert plan.weights_bytes == SHAPES["qwen3-30b-a3b"].num_params * 2        # all 128 experts, bf16


def test_sliding_window_layers_hold_only_their_windows_blocks():
    gemma = SHAPES["gemma-3-12b"]
    assert (gemma.num_sliding_layers, gemma.sliding_window) == (40, 1024)
    per_layer_block = 2 * 8 * 256 * 2 * 16
    # 1300 tokens = 82 blocks; a 1024 window reaches at most ceil(1023 / 16) + 1 = 65 of them.
    assert request_kv_bytes(gemma, 1300, "bfloat16", 16) == per_layer_block * (8 * 82 + 40 * 65)
    assert request_kv_bytes(gemma, 500, "bfloat16", 16) == per_layer_block * 48 * 32     # within the window
    plan = plan_kv_cache(gemma, 80)
    assert plan.paged_requests == plan.kv_budget_bytes // (per_layer_block * (8 * 82 + 40 * 65))
    dense = ModelShape(**{**vars(gemma), "sliding_window": 0, "num_sliding_layers": 0})
    assert plan.paged_requests > plan_kv_cache(dense, 80).paged_requests


def test_hf_config_json_of_the_new_families(tmp_path):
    moe = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
           "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
           "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
           "rope_theta": 1e6, "norm_topk_prob": True}
    (tmp_path / "config.json").write_text(json.dumps(moe))
    assert load_shape(str(tmp_path)) == ModelShape(**{**vars(SHAPES["qwen3-30b-a3b"]), "name": tmp_path.name})
    gemma = {"model_type": "gemma3_text", "num_hidden_layers": 12, "hidden_size": 256, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 512, "vocab_size": 1000,
             "max_position_embeddings": 4096, "sliding_window": 512, "sliding_window_pattern": 6}
    (tmp_path / "config.json").write_text(json.dumps(gemma))
    shape = load_shape(str(tmp_path))
    assert (shape.num_sliding_layers, shape.sliding_window, shape.tie_word_embeddings) == (10, 512, True)


def test_make_sizing_covers_the_new_families():
    out = subprocess.run([sys.executable, "-m", "services.worker.sizing", "--gpu-memory", "141"],
                         capture_output=True, text=True, check=True).stdout
    for name in ("llama-2-13b", "qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b", "gemma-3-12b"):
        assert f"{name} on a 141 GiB GPU" in out
    assert "128 x 768 in 48 layers, top 8: all resident" in out
    assert "40 of 48 layers see the last 1024 tokens" in out


def test_tensor_parallel_plans_are_per_gpu():
    """Llama-3-70B on 4 and 8 H200s: each GPU holds 1/N of the weights and of the 8 KV heads; TP 1 has no room."""
    shape = SHAPES["llama-3-70b"]
    with pytest.raises(SizingError, match="no room for even one KV block"):
        plan_kv_cache(shape, 139.8)
    four, eight = (plan_kv_cache(shape, 139.8, tensor_parallel=n) for n in (4, 8))
    assert four.kv_bytes_per_token == 2 * 80 * 2 * 128 * 2 and eight.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2
    assert eight.weights_bytes == pytest.approx(shape.num_params * 2 / 8, abs=1)
    assert eight.num_blocks > 2 * four.num_blocks > 0 and eight.paged_requests > four.paged_requests
    assert "8 x 139.8 GiB GPUs (tensor parallel; figures per GPU)" in format_plan(eight)
    # 16 ranks over 8 KV heads: each holds one head, replicated on two GPUs.
    assert plan_kv_cache(shape, 139.8, tensor_parallel=16).kv_bytes_per_token == eight.kv_bytes_per_token
    with pytest.raises(SizingError, match="tensor parallel 3 does not split its 64 attention heads"):
        plan_kv_cache(shape, 139.8, tensor_parallel=3)

"""Named model shapes: the published architectures llmserve knows by name.

Random-weight models (random:<shape>) are built at these shapes, and the KV-cache sizing tool
(services/worker/sizing.py) sizes them. Torch-free, so the sizing stays importable without torch.
"""

from __future__ import annotations

from services.worker.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig

NAMED_SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(name="tiny", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                        max_context_length=2048, tie_word_embeddings=True, bos_token_id=None),
    "smollm2-135m": ModelConfig(name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                                rms_norm_eps=1e-5, max_context_length=8192, tie_word_embeddings=True,
                                bos_token_id=None),
    "llama-2-7b": ModelConfig(name="llama-2-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                              num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, rope_theta=10000.0,
                              rms_norm_eps=1e-5, max_context_length=4096, tie_word_embeddings=False,
                              bos_token_id=None),
    "llama-2-13b": ModelConfig(name="llama-2-13b", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                               num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128, rope_theta=10000.0,
                               rms_norm_eps=1e-5, max_context_length=4096, tie_word_embeddings=False,
                               bos_token_id=None),
    "llama-2-70b": ModelConfig(name="llama-2-70b", vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                               num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=10000.0,
                               rms_norm_eps=1e-5, max_context_length=4096, tie_word_embeddings=False,
                               bos_token_id=None),
    "llama-3-8b": ModelConfig(name="llama-3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                              rms_norm_eps=1e-5, max_context_length=8192, tie_word_embeddings=False,
                              bos_token_id=None),
    "llama-3.1-8b": ModelConfig(name="llama-3.1-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                                rms_norm_eps=1e-5, max_context_length=131072, tie_word_embeddings=False,
                                bos_token_id=None,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3-70b": ModelConfig(name="llama-3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                               num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                               rms_norm_eps=1e-5, max_context_length=8192, tie_word_embeddings=False,
                               bos_token_id=None),
    "qwen2.5-7b": ModelConfig(name="qwen2.5-7b", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1000000.0,
                              rms_norm_eps=1e-6, max_context_length=32768, tie_word_embeddings=False,
                              bos_token_id=None, qkv_bias=True),
    "qwen3-8b": ModelConfig(name="qwen3-8b", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0,
                            rms_norm_eps=1e-6, max_context_length=40960, tie_word_embeddings=False,
                            bos_token_id=None, architecture="qwen3", qk_norm=True),
    # 128 experts of 768, 8 routed per token (renormalised): 30.5 B parameters resident, 3.3 B active.
    "qwen3-30b-a3b": ModelConfig(name="qwen3-30b-a3b", vocab_size=151936, hidden_size=2048,
                                 intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                                 rope_theta=1000000.0, rms_norm_eps=1e-6, max_context_length=40960,
                                 tie_word_embeddings=False, bos_token_id=None, architecture="qwen3_moe",
                                 qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                 moe_renormalize=True),
    "mixtral-8x7b": ModelConfig(name="mixtral-8x7b", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0,
                                rms_norm_eps=1e-5, max_context_length=32768, tie_word_embeddings=False,
                                bos_token_id=None, architecture="mixtral", num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=14336, moe_renormalize=True),
    # The text model of Gemma 3 12B: five sliding layers (window 1024, rotary base 10,000) to each
    # global one (base 1,000,000, linear scaling 8).
    "gemma-3-12b": ModelConfig(name="gemma-3-12b", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                               num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256, rope_theta=1000000.0,
                               rms_norm_eps=1e-6, max_context_length=131072, tie_word_embeddings=True,
                               bos_token_id=None, architecture="gemma3_text", qk_norm=True, hidden_act="gelu_tanh",
                               attention_scale=256 ** -0.5, rope_scaling={"rope_type": "linear", "factor": 8.0},
                               sliding_window=1024, sliding_rope_theta=10000.0,
                               layer_types=tuple(SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION
                                                 for i in range(48))),
}

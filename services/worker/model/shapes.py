"""Named model shapes: the published architectures llmserve knows by name.

Random-weight models (random:<shape>) are built at these shapes, and the KV-cache sizing tool
(services/worker/sizing.py) sizes them. Torch-free, so the sizing stays importable without torch.
"""

from __future__ import annotations

from services.worker.model.config import ModelConfig

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
}

"""Triton kernels for the GPU path, one per module, each checked against a PyTorch reference:

    paged_attention  attention over the paged KV cache for mixed batches (decode, prefill,
                     chunked prefill, speculative verification)
    split_kv         the same, with long contexts cut into segments computed in parallel
    write_kv         new keys and values into their cache slots
    rms_norm         RMSNorm, optionally fused with the residual add
    rotary           rotary position embedding (rotate-half layout)
    silu_mul         SiLU-and-multiply of a fused gate/up projection
    backend          TritonPagedAttention, the AttentionBackend built on the first three

Nothing is imported here, so that importing the package does not import Triton.
"""

"""Mixture-of-experts feed-forward layers: top-k routing and the experts' gated MLPs, one module
per idea:

    routing    router logits -> each token's top-k experts and weights; rows grouped by expert
    backend    the FusedMoE interface, its argument checks and select_moe_backend
    torch_moe  the PyTorch path (CPU) and the reference for the kernel
    triton_moe the Triton path (GPU): one grouped GEMM launch per projection

Nothing is imported here, so that importing the package does not import Triton.
"""

"""The interface between a model's mixture-of-experts layer and its kernels.

    fused_moe(hidden [T, H], router_logits [T, E], w_gate_up [E, 2I, H], w_down [E, H, I],
              top_k, renormalize, activation="silu") -> [T, H] in hidden's dtype

Each token goes to its top_k experts by softmax of its router logits (renormalize: the top-k
weights rescaled to sum to 1); expert e computes down(act(gate(x)) * up(x)), act one of
ACTIVATIONS, with
gate = w_gate_up[e, :I], up = w_gate_up[e, I:] (transformers 5's `experts.gate_up_proj` as it is;
Mixtral's w1 / w3 and Qwen3-MoE's gate_proj / up_proj stacked gate first) and down = w_down[e]
(Mixtral's w2, Qwen3-MoE's down_proj); the token's output is the weighted sum over its experts.
The PyTorch path is the CPU path and the reference; the Triton path is the GPU path and must
match it. A model picks the backend by the same name as its attention backend.
"""

from __future__ import annotations

from typing import Protocol

import torch

ACTIVATIONS = ("silu", "gelu_tanh")   # SwiGLU, GeGLU (tanh-approximated GELU)


class FusedMoE(Protocol):
    name: str

    def __call__(self, hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, top_k: int, renormalize: bool,
                 activation: str = "silu") -> torch.Tensor:
        """-> [num_tokens, hidden_size], the experts' weighted sum per token."""


def check_moe_args(hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                   w_down: torch.Tensor, top_k: int, activation: str) -> None:
    """Raises ValueError naming the argument whose shape disagrees with the others."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [tokens, hidden_size], got {tuple(hidden.shape)}")
    tokens, hidden_size = hidden.shape
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] % 2 or w_gate_up.shape[2] != hidden_size:
        raise ValueError(f"w_gate_up must be [experts, 2 * intermediate, {hidden_size}], "
                         f"got {tuple(w_gate_up.shape)}")
    experts, intermediate = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    if tuple(w_down.shape) != (experts, hidden_size, intermediate):
        raise ValueError(f"w_down must be [{experts}, {hidden_size}, {intermediate}], "
                         f"got {tuple(w_down.shape)}")
    if tuple(router_logits.shape) != (tokens, experts):
        raise ValueError(f"router_logits must be [{tokens}, {experts}], got {tuple(router_logits.shape)}")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be an int in 1..{experts}, got {top_k!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r} (supported: {', '.join(ACTIVATIONS)})")


def select_moe_backend(name: str, device: torch.device) -> FusedMoE:
    """'auto' picks Triton on CUDA and PyTorch elsewhere, as select_backend does for attention;
    'cpu' (the CPU attention backend's name, which the model passes on) is PyTorch's experts too."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name in ("torch", "cpu"):
        from services.worker.moe.torch_moe import TorchFusedMoE
        return TorchFusedMoE()
    if name == "triton":
        from services.worker.moe.triton_moe import TritonFusedMoE
        return TritonFusedMoE()
    raise ValueError(f"unknown MoE backend {name!r} (auto, cpu, torch, triton)")

"""The mixture-of-experts layer in plain PyTorch: the CPU path and the reference for the Triton
kernel. Rows (token, k) are sorted by expert; each expert that got rows runs its gated MLP on
them as two matrix products; outputs are weighted and summed per token in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.moe.backend import check_moe_args
from services.worker.moe.routing import route


_ACTIVATION = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class TorchFusedMoE:
    name = "torch"

    def __call__(self, hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, top_k: int, renormalize: bool,
                 activation: str = "silu") -> torch.Tensor:
        check_moe_args(hidden, router_logits, w_gate_up, w_down, top_k, activation)
        routing = route(router_logits, top_k, renormalize)
        flat = routing.experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
        weights = routing.weights.flatten()
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = order[start:start + count]
            start += count
            tokens = rows // top_k
            gate, up = F.linear(hidden[tokens], w_gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(_ACTIVATION[activation](gate) * up, w_down[expert])
            out.index_add_(0, tokens, y.float() * weights[rows, None])
        return out.to(hidden.dtype)

"""Token-to-expert routing for mixture-of-experts layers.

route: softmax over the router logits (fp32), the top-k experts of each token, and optionally
their weights renormalised to sum to 1 (Mixtral always; Qwen3-MoE when norm_topk_prob). The
(token, k) pairs are the layer's rows, row r = token * top_k + k.

group_by_expert lays the rows out for a grouped GEMM: sorted by expert, each expert's group
padded to a multiple of block_m, so each block of block_m rows belongs to one expert. Its shapes
depend on the token count only (never on the routing), and it never reads a device value on the
host, so a CUDA graph can capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Routing:
    weights: torch.Tensor      # float32 [num_tokens, top_k]
    experts: torch.Tensor      # int64 [num_tokens, top_k]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """router_logits [num_tokens, num_experts] -> each token's top_k experts and weights."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, experts)


@dataclass
class ExpertGroups:
    rows: torch.Tensor          # int32 [capacity]: row ids grouped by expert; num_rows = padding
    block_expert: torch.Tensor  # int32 [capacity // block_m]: the expert of each block, -1 = unused
    num_rows: int               # num_tokens * top_k
    block_m: int


def group_capacity(num_rows: int, num_experts: int, block_m: int) -> int:
    """Rows after padding, at most: every non-empty group (at most min(E, rows) of them) wastes
    fewer than block_m rows. A multiple of block_m."""
    bound = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return -(-bound // block_m) * block_m


def group_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertGroups:
    """experts int [num_tokens, top_k] -> the rows grouped by expert in block_m-row blocks."""
    flat = experts.flatten().long()
    num_rows = flat.numel()
    device = flat.device
    capacity = group_capacity(num_rows, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_rows, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    rows = torch.full((capacity,), num_rows, dtype=torch.int32, device=device)
    rows[(padded_end - padded)[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertGroups(rows, block_expert, num_rows, block_m)

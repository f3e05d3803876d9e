"""Mixture-of-experts families: Qwen3-MoE and Mixtral.

Their decoder layer is Llama's (Qwen3-MoE with q/k norms) with the MLP replaced by a routed one:
a router linear gives each token's logits over the experts, and the fused-MoE kernel
(services/worker/moe, picked by the attention backend's name) sends the token to its top-k
experts, softmax weights optionally renormalised (Mixtral always, Qwen3-MoE with norm_topk_prob).
Every expert's weights are resident, stacked as transformers 5 stores them: gate_up_proj
[E, 2I, H] (gate rows first), down_proj [E, H, I]. Checkpoints name them per expert
(Qwen3-MoE: mlp.experts.N.gate_proj / up_proj / down_proj; Mixtral: block_sparse_moe.experts.N.w1 /
w3 / w2, its router block_sparse_moe.gate) or already stacked (mlp.experts.gate_up_proj, ...).
Qwen3-MoE layers in dense_layers keep a dense MLP. In a tensor-parallel group every rank holds
every expert's share of the intermediate features (gate/up column-, down row-split), so each
rank's fused-MoE output is a partial sum that one all-reduce completes; the router is replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.attention.backend import AttentionBackend
from services.worker.model.config import ModelConfig
from services.worker.model.decoder import ATTENTION_RULES, MLP_RULES, CausalLM, WeightRule
from services.worker.model.layers import DecoderLayer, GatedMLP, Linear, _empty, split
from services.worker.moe.backend import select_moe_backend
from services.worker.parallel.group import TensorParallel


class Experts(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype, device):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        local = i // tp.size
        self.gate_up_proj = split(_empty(e, 2 * local, h, dtype=dtype, device=device), -2, (i, i), (local, local))
        self.down_proj = split(_empty(e, h, local, dtype=dtype, device=device), -1, (i,), (local,))


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, fused_moe, tp: TensorParallel, dtype, device):
        super().__init__()
        self.gate = Linear(config.hidden_size, config.num_experts, False, dtype, device)   # the router
        self.experts = Experts(config, tp, dtype, device)
        self.top_k, self.renormalize = config.num_experts_per_tok, config.moe_renormalize
        self.fused_moe, self.tp = fused_moe, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.fused_moe(x, self.gate(x), self.experts.gate_up_proj, self.experts.down_proj,
                                                 self.top_k, self.renormalize))


class MoEModel(CausalLM):
    def make_layer(self, layer: int, attention: AttentionBackend, dtype, device) -> nn.Module:
        c = self.config
        if c.is_moe(layer):
            device = torch.device(device)
            mlp = SparseMoE(c, select_moe_backend(attention.name, device), self.tp, dtype, device)
        else:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype, device, self.tp)
        return DecoderLayer(c, layer, attention, mlp, dtype, device, tp=self.tp)


def _expert_rules(prefix: str, gate: str, up: str, down: str) -> tuple[WeightRule, ...]:
    experts = "layers.{L}.mlp.experts."
    return (WeightRule(f"{prefix}.experts.{{E}}.{gate}.weight", experts + "gate_up_proj", "gate"),
            WeightRule(f"{prefix}.experts.{{E}}.{up}.weight", experts + "gate_up_proj", "up"),
            WeightRule(f"{prefix}.experts.{{E}}.{down}.weight", experts + "down_proj"))


class Qwen3MoeModel(MoEModel):
    WEIGHT_RULES = ATTENTION_RULES + MLP_RULES + _expert_rules("layers.{L}.mlp", "gate_proj", "up_proj", "down_proj")


class MixtralModel(MoEModel):
    WEIGHT_RULES = ATTENTION_RULES + _expert_rules("layers.{L}.block_sparse_moe", "w1", "w3", "w2") + (
        WeightRule("layers.{L}.block_sparse_moe.gate.", "layers.{L}.mlp.gate."),)

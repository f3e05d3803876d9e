"""The Llama architecture and the families that differ from it only in configuration.

llama (all rope scalings), qwen2 (q/k/v biases), qwen3 (q/k norms), mistral (sliding window) and
phi3 (longrope, partial rotary): one pre-norm decoder layer with a gated SiLU MLP. Phi-3's
checkpoints hold qkv_proj and gate_up_proj already fused, under our parameters' own names, so
no rule maps them; the others' q/k/v and gate/up are copied into their rows of the fused ones.
"""

from __future__ import annotations

from torch import nn

from services.worker.attention.backend import AttentionBackend
from services.worker.model.decoder import CausalLM
from services.worker.model.layers import DecoderLayer, GatedMLP


class LlamaModel(CausalLM):
    def make_layer(self, layer: int, attention: AttentionBackend, dtype, device) -> nn.Module:
        c = self.config
        mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype, device, self.tp)
        return DecoderLayer(c, layer, attention, mlp, dtype, device, tp=self.tp)

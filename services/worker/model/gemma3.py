"""Gemma 3 (text): what it does differently from Llama.

- Norms scale by (1 + weight), computed in float32 whatever the model's dtype.
- Sandwich norms: each sublayer's output is normed again before it joins the residual.
- The embedding is scaled by sqrt(hidden_size), rounded to the weights' dtype as the reference does.
- GeGLU MLP (tanh-approximated GELU), q/k norms, softmax scale query_pre_attn_scalar ** -0.5.
- Sliding-window layers beside global ones, each kind with its own rotary base
  (CausalLM.sliding_rotary); optional final logit soft-capping.
Multimodal checkpoints (model_type gemma3, gemma-3-4b and up) serve their text model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.backend import AttentionBackend
from services.worker.model.decoder import CausalLM
from services.worker.model.layers import Attention, GatedMLP, RMSNorm
from services.worker.parallel.group import TensorParallel


class GemmaRMSNorm(RMSNorm):
    unit_weight = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer: int, attention: AttentionBackend, dtype, device, tp: TensorParallel):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype, device)
        self.self_attn = Attention(config, layer, attention, GemmaRMSNorm, dtype, device, tp)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype, device)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act, dtype, device, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype, device)

    def forward(self, x, rotary, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rotary, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(CausalLM):
    """Also the text model of a multimodal Gemma 3 checkpoint; its vision tower is not loaded."""
    norm_class = GemmaRMSNorm
    IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

    def make_layer(self, layer: int, attention: AttentionBackend, dtype, device) -> nn.Module:
        return Gemma3DecoderLayer(self.config, layer, attention, dtype, device, self.tp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size ** 0.5).to(x.dtype)   # float32, then rounded

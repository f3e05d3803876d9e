"""A decoder-only language model over a paged KV cache: embedding, decoder layers, final norm, head.

A family module subclasses CausalLM to say what differs: its decoder layer (`make_layer`), norm,
embedding scale and `WEIGHT_RULES`, how Hugging Face tensor names map onto its (fused)
parameters. Whatever the file format, weights arrive under Hugging Face names
(model.layers.N.self_attn.q_proj.weight, ...); a name no rule matches is our own parameter's
name already (minus "model."; a Linear's `weight` is our transposed `weight_t`).
In a tensor-parallel group each rank builds its shard and load_weights copies in its piece of
every full checkpoint tensor (the parameter's TPSplit says which).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from services.worker.attention.backend import AttentionBackend
from services.worker.attention.metadata import AttentionMetadata
from services.worker.model.config import ModelConfig
from services.worker.model.layers import ColumnParallelLinear, Embedding, KVCache, RMSNorm, TPSplit
from services.worker.model.rotary import RotaryEmbedding
from services.worker.parallel.group import SINGLE, TensorParallel

# Tensors some checkpoints carry that the model recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Where a multimodal checkpoint keeps its language model (Gemma 3: saved, and as transformers 5 holds it).
_LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                            "language_model.lm_head.": "lm_head."}


@dataclass(frozen=True)
class WeightRule:
    """Tensors named `source` + rest fill rows `shard` of our `target` + rest.

    Names have no "model." prefix; {L} stands for a layer and {E} for an expert index. shard is
    "q", "k" or "v" (of a fused QKV), "gate" or "up" (the halves of a fused gate/up), or "" (all).
    """
    source: str
    target: str
    shard: str = ""

    @functools.cached_property
    def source_re(self) -> re.Pattern:
        return _template_re(self.source)

    @functools.cached_property
    def target_re(self) -> re.Pattern:
        return _template_re(self.target)


def _template_re(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile(pattern + r"(?P<rest>.*)")


ATTENTION_RULES = (
    WeightRule("layers.{L}.self_attn.q_proj.", "layers.{L}.self_attn.qkv_proj.", "q"),
    WeightRule("layers.{L}.self_attn.k_proj.", "layers.{L}.self_attn.qkv_proj.", "k"),
    WeightRule("layers.{L}.self_attn.v_proj.", "layers.{L}.self_attn.qkv_proj.", "v"),
)
MLP_RULES = (
    WeightRule("layers.{L}.mlp.gate_proj.", "layers.{L}.mlp.gate_up_proj.", "gate"),
    WeightRule("layers.{L}.mlp.up_proj.", "layers.{L}.mlp.gate_up_proj.", "up"),
)


class CausalLM(nn.Module):
    """Parameters are allocated uninitialised on `device`; fill them with load_weights (or random init)."""

    norm_class: type[RMSNorm] = RMSNorm
    WEIGHT_RULES: tuple[WeightRule, ...] = ATTENTION_RULES + MLP_RULES
    IGNORED_PREFIXES: tuple[str, ...] = ()     # tensors of other models in the checkpoint (a vision tower)

    def __init__(self, config: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.config, self.tp = config, tp
        c = config
        self.rotary = RotaryEmbedding(c.head_dim, c.max_context_length, c.rope_theta, c.rope_scaling, device,
                                      rotary_dim=c.rotary_dim)
        # Sliding layers with a rotary base of their own (Gemma 3) read this one.
        self.sliding_rotary = None if c.sliding_rope_theta is None else RotaryEmbedding(
            c.head_dim, c.max_context_length, c.sliding_rope_theta, None, device, rotary_dim=c.rotary_dim)
        self._sliding_rotary_layers = [self.sliding_rotary is not None and c.is_sliding(i)
                                       for i in range(c.num_layers)]
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype, device, tp)
        self.layers = nn.ModuleList(self.make_layer(i, attention, dtype, device) for i in range(c.num_layers))
        self.norm = self.norm_class(c.hidden_size, c.rms_norm_eps, dtype, device)
        # Tied or not, the head is its own transposed matrix (a tied one is filled from the embedding):
        # the lookup wants the embedding's rows, the product its columns. Split by vocabulary like it.
        vocab = c.vocab_size // tp.size
        self.lm_head = ColumnParallelLinear(c.hidden_size, (c.vocab_size,), (vocab,), False, dtype, device)

    def make_layer(self, layer: int, attention: AttentionBackend, dtype, device) -> nn.Module:
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """-> [T, hidden], after the final norm: pick the rows you need and call compute_logits."""
        x = self.embed(input_ids)
        rotary = self.rotary(positions, x.dtype)
        sliding_rotary = self.sliding_rotary(positions, x.dtype) if self.sliding_rotary is not None else None
        for layer, kv_cache, own in zip(self.layers, kv_caches, self._sliding_rotary_layers, strict=True):
            x = layer(x, sliding_rotary if own else rotary, kv_cache, meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        logits = self.tp.all_gather(self.lm_head(hidden)).float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def decode_weight_bytes(self) -> int:
        """Bytes of weights a decode step reads: everything but the embedding table (a row of it).

        Counts quantized linears (which hold packed weights, not parameters) by their own report.
        An MoE layer counts all its experts (a batch of decodes reads most of them).
        """
        params = sum(p.numel() * p.element_size() for name, p in self.named_parameters()
                     if not name.startswith("embed_tokens."))
        packed = sum(m.weight_bytes() for m in self.modules() if hasattr(m, "weight_bytes"))
        return params + packed

    # --- weights ------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters; every parameter must be filled.

        Raises ValueError naming the tensor on an unknown name or a wrong shape, and the missing
        tensors when a parameter is left (partly) unfilled.
        """
        params = dict(self.named_parameters())
        covered = {name: torch.zeros(_rows_shape(_hf_view(name, p)), dtype=torch.bool) for name, p in params.items()}
        tied = self.config.tie_word_embeddings
        for hf_name, tensor in weights:
            hf_name = _language_model_name(hf_name)
            if hf_name.startswith(self.IGNORED_PREFIXES) or hf_name.endswith(_IGNORED_SUFFIXES) \
                    or (tied and hf_name == "lm_head.weight"):
                continue  # some tied checkpoints store the head anyway: it is the embedding
            targets = [self._place(hf_name, params)]
            if tied and hf_name == "model.embed_tokens.weight":
                targets.append(("lm_head.weight_t", ()))
            for name, index in targets:
                target = _hf_view(name, params[name])[index]
                piece = self._rank_piece(hf_name, tensor, target.shape, getattr(params[name], "tp_split", None))
                target.copy_(piece)
                covered[name][index] = True
        missing = [hint for name, mask in covered.items() if not mask.all() for hint in self._missing(name, mask)]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:3])}")

    def _place(self, hf_name: str, params: dict) -> tuple[str, tuple]:
        """Hugging Face tensor name -> (our parameter name, its index in the parameter's HF view)."""
        name = hf_name.removeprefix("model.")
        for rule in self.WEIGHT_RULES:
            match = rule.source_re.fullmatch(name)
            if match:
                groups = match.groupdict()
                name = rule.target.format(L=groups.get("L"), E=groups.get("E")) + groups["rest"]
                index = (int(groups["E"]),) if groups.get("E") is not None else ()
                return self._resolve(hf_name, name, params, index + (self._shard(rule.shard, name, params),))
        return self._resolve(hf_name, name, params, ())

    def _resolve(self, hf_name: str, name: str, params: dict, index: tuple) -> tuple[str, tuple]:
        if name + "_t" in params:      # a Linear weight, stored [in, out]
            name += "_t"
        if name not in params:
            raise ValueError(f"unexpected tensor {hf_name!r} in checkpoint")
        return name, index

    def _shard(self, shard: str, name: str, params: dict) -> slice:
        """The rows of a fused parameter (this rank's) that the q/k/v or gate/up segment fills."""
        if not shard:
            return slice(None)
        local = params.get(name + "_t", params.get(name)).tp_split.local
        i = _SEGMENTS[shard]
        return slice(sum(local[:i]), sum(local[:i + 1]))

    def _rank_piece(self, hf_name: str, tensor: torch.Tensor, shape: torch.Size, split: TPSplit | None) -> torch.Tensor:
        """This rank's piece of a full checkpoint tensor bound for a target of `shape`: the whole
        tensor unsplit; one segment's share; or, for a tensor holding every segment (Phi-3's fused
        qkv_proj, stacked experts), each segment's share, concatenated."""
        if split is not None and self.tp.size > 1 and tensor.dim() == len(shape):
            d, length = split.dim, tensor.shape[split.dim]
            if len(split.full) > 1 and length == sum(split.full) and shape[d] == sum(split.local):
                parts = tensor.split(list(split.full), dim=d)
                tensor = torch.cat([p[_along(d, self.tp.piece(f, n))] for p, f, n in
                                    zip(parts, split.full, split.local)], dim=d)
            elif length in split.full and shape[d] in split.local:
                tensor = tensor[_along(d, self.tp.piece(length, shape[d]))]
        if tensor.shape != shape:
            expected = list(shape)
            if split is not None and len(shape) > 0:
                expected[split.dim] = sum(split.full) if shape[split.dim] == sum(split.local) else \
                    dict(zip(split.local, split.full)).get(shape[split.dim], shape[split.dim])
            raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(expected)} (from config.json)")
        return tensor

    def _missing(self, name: str, mask: torch.Tensor) -> list[str]:
        """The Hugging Face names of the tensors that would fill the unfilled part of parameter `name`."""
        params = dict(self.named_parameters())
        hf_rest = name.removesuffix("_t")
        hints = []
        for rule in self.WEIGHT_RULES:
            match = rule.target_re.fullmatch(hf_rest)
            if not match:
                continue
            groups = match.groupdict()
            rows = self._shard(rule.shard, name.removesuffix("_t"), params)
            experts = range(mask.shape[0]) if "{E}" in rule.source else [None]
            for e in experts:
                if not mask[(e, rows) if e is not None else (rows,)].all():
                    hints.append("model." + rule.source.format(L=groups.get("L"), E=e) + groups["rest"])
        if not hints:
            hints.append(("" if name.startswith("lm_head") else "model.") + hf_rest)
        return hints


_SEGMENTS = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}


def _along(dim: int, index: slice) -> tuple:
    """An index applying `index` along dimension `dim` (negative: from the end)."""
    return (Ellipsis, index) + (slice(None),) * (-dim - 1) if dim < 0 else (slice(None),) * dim + (index,)


def _language_model_name(hf_name: str) -> str:
    for prefix, replacement in _LANGUAGE_MODEL_PREFIXES.items():
        if hf_name.startswith(prefix):
            return replacement + hf_name.removeprefix(prefix)
    return hf_name


def _hf_view(name: str, param: torch.Tensor) -> torch.Tensor:
    """The parameter as Hugging Face lays it out ([out, in] for a Linear weight)."""
    return param.data.t() if name.endswith("weight_t") else param.data


def _rows_shape(view: torch.Tensor) -> tuple[int, ...]:
    """What the loader tracks as filled: rows of a matrix (and experts of a stack), elements of a vector."""
    return tuple(view.shape[:-1]) if view.dim() >= 2 else tuple(view.shape)

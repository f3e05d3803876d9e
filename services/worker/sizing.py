"""KV-cache sizing: how many tokens, blocks and concurrent requests fit on one GPU.

    python -m services.worker.sizing --model llama-2-13b qwen3-30b-a3b --gpu-memory 80 40
    python -m services.worker.sizing --model path/to/config.json --gpu-memory 141 --kv-dtype fp8
    python -m services.worker.sizing --model llama-3-70b --gpu-memory 139.8 --tensor-parallel 4 8

The arithmetic (memory in GiB, 2^30 bytes, as nvidia-smi and torch report it):
- KV bytes per token = 2 (K and V) x layers x KV heads x head dim x KV dtype bytes;
- KV budget = GPU memory x utilisation - weights (parameters x weight dtype bytes) - overhead
  (activations, CUDA graphs, allocator slack: measure it, 0 by default); a mixture-of-experts
  model keeps every expert resident, so all of them count, not only the top-k a token uses;
- blocks = budget // (block size x bytes per token);
- paged concurrency: a request holds ceil((prompt + output) / block size) blocks, no more; in a
  sliding-window layer (Gemma 3, Mistral) only the blocks its window reaches, at most
  ceil((W - 1) / block size) + 1, since blocks wholly before every window may return to the pool;
- contiguous concurrency: every request reserves the full context length up front (the
  pre-paging way, and what TGI-style admission does with max_tokens = context; a sliding layer
  reserves its window).

With tensor parallelism over N GPUs (engine.tensor_parallel_size) every figure is per GPU: each
holds 1/N of the weights and of the KV heads (one head, replicated, when there are fewer KV heads
than GPUs), and every rank has the same number of blocks, so the blocks (and requests) of one GPU
are those of the whole worker.

Nothing here imports torch, so the worker can log `kv_cache_report` at start for free.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from services.worker.model.config import ModelConfig
from services.worker.model.hf_config import model_config_from_hf
from services.worker.model.shapes import NAMED_SHAPES

GIB = 1 << 30

DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
    "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
    "int4": 0.5,                      # weights only (GPTQ/AWQ-style packing, scales ignored)
}
KV_DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16",
             "fp8", "float8_e4m3fn", "float8_e5m2", "int8")


class SizingError(ValueError):
    """An input the sizing cannot work with; the message says which and why."""


class KVShape(Protocol):
    """What the KV cache's size depends on; services.worker.model.config.ModelConfig has it too."""
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context_length: int


def kv_bytes_per_token(shape: KVShape, kv_dtype: str) -> int:
    """K and V, every layer, every KV head."""
    return int(2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes(kv_dtype, KV_DTYPES))


def request_kv_bytes(shape: ModelShape, tokens: int, kv_dtype: str, block_size: int) -> int:
    """KV of one request of `tokens` tokens in whole blocks: a full-attention layer holds every
    block, a sliding-window layer those its window reaches (at most ceil((W - 1) / block) + 1)."""
    per_layer_block = kv_bytes_per_token(shape, kv_dtype) // shape.num_layers * block_size
    blocks = math.ceil(tokens / block_size)
    sliding = min(blocks, math.ceil((shape.sliding_window - 1) / block_size) + 1) if shape.sliding_window else blocks
    return per_layer_block * ((shape.num_layers - shape.num_sliding_layers) * blocks + shape.num_sliding_layers * sliding)


def reserved_kv_bytes(shape: ModelShape, context: int, kv_dtype: str) -> int:
    """KV a contiguous reservation of `context` tokens takes: a sliding layer reserves its window."""
    per_layer_token = kv_bytes_per_token(shape, kv_dtype) // shape.num_layers
    sliding = min(context, shape.sliding_window) if shape.sliding_window else context
    return per_layer_token * ((shape.num_layers - shape.num_sliding_layers) * context + shape.num_sliding_layers * sliding)


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only (Llama-style) model that decide its memory."""
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_context_length: int
    head_dim: int = 0                 # 0: hidden_size // num_heads
    tie_word_embeddings: bool = False
    num_experts: int = 0              # > 0: num_moe_layers layers route each token to experts_per_token of them
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_moe_layers: int = 0
    sliding_window: int = 0           # > 0: num_sliding_layers layers attend to the last W positions only
    num_sliding_layers: int = 0

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                      "intermediate_size", "vocab_size", "max_context_length"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SizingError(f"{self.name}: {field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise SizingError(f"{self.name}: num_heads ({self.num_heads}) must be a multiple of "
                              f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise SizingError(f"{self.name}: hidden_size ({self.hidden_size}) is not divisible "
                                  f"by num_heads ({self.num_heads}); give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        elif self.head_dim < 0:
            raise SizingError(f"{self.name}: head_dim must be positive, got {self.head_dim}")
        if not 0 <= self.num_moe_layers <= self.num_layers or not 0 <= self.num_sliding_layers <= self.num_layers:
            raise SizingError(f"{self.name}: MoE and sliding layers must be between 0 and num_layers")

    @property
    def num_params(self) -> int:
        """Parameters of the block stack: attention, gated MLPs (every expert of an MoE layer and
        its router), RMS norms; the embedding and the head."""
        return self._params(self.num_experts)

    @property
    def active_params(self) -> int:
        """Parameters one token's forward pass reads: the top-k experts of each MoE layer."""
        return self._params(self.experts_per_token)

    def _params(self, experts: int) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + 2 * h
        dense_mlp = 3 * h * self.intermediate_size
        moe_mlp = experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
        mlps = (self.num_layers - self.num_moe_layers) * dense_mlp + self.num_moe_layers * moe_mlp
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * attention + mlps + heads * self.vocab_size * h + h

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "") -> ModelShape:
        """From a Hugging Face config.json, read as the worker reads it (hf_config.py); a file
        without model_type is read as a Llama."""
        name = name or str(config.get("_name_or_path") or config.get("model_type") or "model")
        try:
            model = model_config_from_hf(name, {"model_type": "llama", **config})
        except ValueError as e:
            raise SizingError(f"{name}: config.json: {e}") from None
        return cls.of(model)

    @classmethod
    def of(cls, config: ModelConfig) -> ModelShape:
        layers = range(config.num_layers)
        return cls(name=config.name, num_layers=config.num_layers, hidden_size=config.hidden_size,
                   num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                   intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
                   max_context_length=config.max_context_length, head_dim=config.head_dim,
                   tie_word_embeddings=config.tie_word_embeddings, num_experts=config.num_experts,
                   experts_per_token=config.num_experts_per_tok, moe_intermediate_size=config.moe_intermediate_size,
                   num_moe_layers=sum(config.is_moe(i) for i in layers),
                   sliding_window=config.sliding_window or 0,
                   num_sliding_layers=sum(config.is_sliding(i) for i in layers))


SHAPES: dict[str, ModelShape] = {name: ModelShape.of(config) for name, config in NAMED_SHAPES.items()}
# What `make sizing` prints: a dense Llama, and the families whose memory differs (MoE, sliding window).
DEFAULT_MODELS = ("llama-2-13b", "qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b", "gemma-3-12b")


def dtype_bytes(dtype: str, allowed: tuple[str, ...] = tuple(DTYPE_BYTES)) -> float:
    if dtype not in allowed:
        raise SizingError(f"unknown dtype {dtype!r}; one of {', '.join(allowed)}")
    return DTYPE_BYTES[dtype]


def load_shape(spec: str) -> ModelShape:
    """A named shape (see SHAPES) or the path of a Hugging Face config.json (or its folder)."""
    if spec in SHAPES:
        return SHAPES[spec]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SizingError(f"{spec!r} is neither a known model ({', '.join(SHAPES)}) "
                          f"nor a config.json file")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SizingError(f"{path}: not a readable JSON file: {e}") from None
    if not isinstance(config, dict):
        raise SizingError(f"{path}: the top level must be a JSON object")
    return ModelShape.from_hf_config(config, name=path.parent.name or path.stem)


@dataclass(frozen=True)
class KVCachePlan:
    shape: ModelShape
    gpu_bytes: int
    utilisation: float
    overhead_bytes: int
    weights_dtype: str
    kv_dtype: str
    block_size: int
    prompt_tokens: int
    output_tokens: int
    max_model_len: int
    tensor_parallel: int = 1          # GPUs the model is split over; every figure is one GPU's

    def __post_init__(self) -> None:
        tp, heads, kv = self.tensor_parallel, self.shape.num_heads, self.shape.num_kv_heads
        if not isinstance(tp, int) or tp < 1:
            raise SizingError(f"tensor parallel size must be a positive integer, got {tp!r}")
        if heads % tp or (kv % tp and tp % kv):
            raise SizingError(f"{self.shape.name}: tensor parallel {tp} does not split its {heads} attention "
                              f"heads and {kv} KV heads evenly")
        if self.gpu_bytes <= 0:
            raise SizingError(f"GPU memory must be positive, got {self.gpu_bytes / GIB:g} GiB")
        if not 0 < self.utilisation <= 1:
            raise SizingError(f"utilisation must be in (0, 1], got {self.utilisation}")
        if self.overhead_bytes < 0:
            raise SizingError("overhead must not be negative")
        dtype_bytes(self.weights_dtype)
        dtype_bytes(self.kv_dtype, KV_DTYPES)
        if self.block_size <= 0:
            raise SizingError(f"block size must be positive, got {self.block_size}")
        if self.prompt_tokens < 0 or self.output_tokens < 0 or self.request_tokens == 0:
            raise SizingError("a request needs a non-negative prompt and output, not both 0")
        if self.max_model_len <= 0:
            raise SizingError(f"max model length must be positive, got {self.max_model_len}")
        if self.request_tokens > self.max_model_len:
            raise SizingError(f"a request of {self.request_tokens} tokens exceeds the "
                              f"{self.max_model_len}-token context")
        if self.kv_budget_bytes < self.block_bytes:
            raise SizingError(
                f"{self.shape.name}: weights take {self.weights_bytes / GIB:.1f} GiB of the "
                f"{self.usable_bytes / GIB:.1f} GiB usable on a {self.gpu_bytes / GIB:g} GiB GPU: "
                f"no room for even one KV block")

    @property
    def request_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def kv_shape(self) -> ModelShape:
        """The shape as one GPU's KV cache sees it: its KV heads."""
        return replace(self.shape, num_kv_heads=max(1, self.shape.num_kv_heads // self.tensor_parallel))

    @property
    def weights_bytes(self) -> int:
        """One GPU's share (the replicated norms are negligible)."""
        return int(self.shape.num_params * dtype_bytes(self.weights_dtype) / self.tensor_parallel)

    @property
    def usable_bytes(self) -> int:
        return int(self.gpu_bytes * self.utilisation) - self.overhead_bytes

    @property
    def kv_budget_bytes(self) -> int:
        return self.usable_bytes - self.weights_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.kv_shape, self.kv_dtype)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    @property
    def num_blocks(self) -> int:
        return self.kv_budget_bytes // self.block_bytes

    @property
    def request_kv_bytes(self) -> int:
        return request_kv_bytes(self.kv_shape, self.request_tokens, self.kv_dtype, self.block_size)

    @property
    def paged_requests(self) -> int:
        return self.kv_budget_bytes // self.request_kv_bytes

    @property
    def contiguous_requests(self) -> int:
        return self.kv_budget_bytes // reserved_kv_bytes(self.kv_shape, self.max_model_len, self.kv_dtype)


def plan_kv_cache(shape: ModelShape, gpu_memory_gib: float, *, weights_dtype: str = "bfloat16",
                  kv_dtype: str | None = None, block_size: int = 16, utilisation: float = 0.9,
                  overhead_gib: float = 0.0, prompt_tokens: int = 1000, output_tokens: int = 300,
                  max_model_len: int | None = None, tensor_parallel: int = 1) -> KVCachePlan:
    """kv_dtype defaults to the weights' dtype; max_model_len to the model's context."""
    return KVCachePlan(shape=shape, gpu_bytes=int(gpu_memory_gib * GIB), utilisation=utilisation,
                       overhead_bytes=int(overhead_gib * GIB), weights_dtype=weights_dtype,
                       kv_dtype=kv_dtype or weights_dtype, block_size=block_size,
                       prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                       max_model_len=max_model_len or shape.max_context_length, tensor_parallel=tensor_parallel)


def format_plan(plan: KVCachePlan) -> str:
    s, gib, kv = plan.shape, GIB, plan.kv_shape
    where = f"a {plan.gpu_bytes / gib:g} GiB GPU" if plan.tensor_parallel == 1 else \
        f"{plan.tensor_parallel} x {plan.gpu_bytes / gib:g} GiB GPUs (tensor parallel; figures per GPU)"
    lines = [
        f"{s.name} on {where} (utilisation {plan.utilisation:g}, "
        f"overhead {plan.overhead_bytes / gib:g} GiB)",
        f"  shape               {s.num_layers} layers, {s.num_kv_heads} KV heads x {s.head_dim} "
        f"head dim, {s.num_params / 1e9:.2f} B parameters",
        f"  KV per token        {_kib(plan.kv_bytes_per_token)} ({plan.kv_dtype}) = 2 x "
        f"{s.num_layers} x {kv.num_kv_heads} x {s.head_dim} x {DTYPE_BYTES[plan.kv_dtype]:g} bytes",
        f"  weights             {plan.weights_bytes / gib:.1f} GiB ({plan.weights_dtype})",
        *_moe_lines(s),
        *_sliding_lines(plan),
        f"  KV budget           {plan.kv_budget_bytes / gib:.1f} GiB = {plan.usable_bytes / gib:.1f}"
        f" usable - {plan.weights_bytes / gib:.1f} weights",
        f"  blocks              {plan.num_blocks} x {plan.block_size} tokens = "
        f"{plan.num_blocks * plan.block_size} tokens",
        f"  requests of {plan.prompt_tokens} + {plan.output_tokens} tokens at once:",
        f"    paged             {plan.paged_requests} "
        f"({math.ceil(plan.request_tokens / plan.block_size)} blocks each"
        f"{', ' + _mib(plan.request_kv_bytes) if s.num_sliding_layers else ''})",
        f"    contiguous        {plan.contiguous_requests} (each reserves the "
        f"{plan.max_model_len}-token context, {_mib(reserved_kv_bytes(kv, plan.max_model_len, plan.kv_dtype))})",
    ]
    if plan.contiguous_requests:
        lines.append(f"    paging gain       {plan.paged_requests / plan.contiguous_requests:.1f}x")
    return "\n".join(lines)


def _moe_lines(s: ModelShape) -> list[str]:
    if not s.num_experts:
        return []
    return [f"  experts             {s.num_experts} x {s.moe_intermediate_size} in {s.num_moe_layers} layers, "
            f"top {s.experts_per_token}: all resident, {s.active_params / 1e9:.2f} B parameters active per token"]


def _sliding_lines(plan: KVCachePlan) -> list[str]:
    s = plan.shape
    if not s.num_sliding_layers:
        return []
    full = math.ceil(plan.request_tokens / plan.block_size) * plan.block_bytes
    return [f"  sliding window      {s.num_sliding_layers} of {s.num_layers} layers see the last {s.sliding_window} "
            f"tokens: a {plan.request_tokens}-token request holds {_mib(plan.request_kv_bytes)} of KV, "
            f"not {_mib(full)}"]


def kv_cache_report(shape: KVShape, num_blocks: int, block_size: int, kv_dtype: str,
                    request_tokens: int = 1300, max_model_len: int | None = None) -> str:
    """One line for the worker's start-up log: the same figures as the command, for the pool it built."""
    if num_blocks <= 0 or block_size <= 0 or request_tokens <= 0:
        raise SizingError("num_blocks, block_size and request_tokens must be positive")
    per_token = kv_bytes_per_token(shape, kv_dtype)
    tokens = num_blocks * block_size
    context = max_model_len or shape.max_context_length
    return (f"KV cache: {shape.name}, {_kib(per_token)}/token ({kv_dtype}), {num_blocks} blocks x "
            f"{block_size} tokens = {tokens} tokens ({tokens * per_token / GIB:.2f} GiB); "
            f"{request_tokens}-token requests at once: "
            f"{num_blocks // math.ceil(request_tokens / block_size)} paged, "
            f"{tokens // context} with {context}-token contiguous reservations")


def _kib(n: int) -> str:
    return f"{n / 1024:g} KiB"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.worker.sizing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=list(DEFAULT_MODELS),
                        help=f"one or more of {', '.join(SHAPES)}, or config.json paths "
                             f"(default {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--gpu-memory", type=float, nargs="+", default=[80.0, 40.0], metavar="GIB",
                        help="GPU memory in GiB, one or more (default 80 40)")
    parser.add_argument("--weights-dtype", default="bfloat16", help="default bfloat16")
    parser.add_argument("--kv-dtype", default=None, help="default: the weights' dtype")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--utilisation", type=float, default=0.9,
                        help="fraction of GPU memory the worker may use (default 0.9)")
    parser.add_argument("--overhead", type=float, default=0.0, metavar="GIB",
                        help="activations and workspace to set aside, GiB (default 0)")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--output-tokens", type=int, default=300)
    parser.add_argument("--tensor-parallel", type=int, nargs="+", default=[1], metavar="N",
                        help="GPUs each model is split over, one or more (default 1)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context each contiguous reservation holds (default: the model's)")
    args = parser.parse_args(argv)
    sections, errors = [], []
    for model in args.model:
        for gib, tp in ((gib, tp) for gib in args.gpu_memory for tp in args.tensor_parallel):
            try:
                sections.append(format_plan(plan_kv_cache(
                    load_shape(model), gib, weights_dtype=args.weights_dtype, kv_dtype=args.kv_dtype,
                    block_size=args.block_size, utilisation=args.utilisation, overhead_gib=args.overhead,
                    prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                    max_model_len=args.max_model_len, tensor_parallel=tp)))
            except SizingError as e:
                errors.append(str(e))
                sections.append(str(e))
    if len(errors) == len(sections):   # nothing to show: a usage error
        parser.error("; ".join(dict.fromkeys(errors)))
    print("\n\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())

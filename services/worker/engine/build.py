"""Assembles an engine from the worker's configuration: model, KV cache size, runner, sampler."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.worker.attention.backend import select_backend
from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.cpu_features import has_native_bfloat16
from services.worker.engine.host_allocator import keep_freed_memory
from services.worker.engine.llm_engine import EngineLimits, LLMEngine
from services.worker.engine.model_runner import ModelRunner
from services.worker.engine.sampler import Sampler
from services.worker.model.loader import LoadedModel, load_model
from services.worker.parallel.driver import TensorParallelWorkers, kv_shape, start_tensor_parallel
from services.worker.parallel.group import SINGLE
from services.worker.sizing import kv_bytes_per_token, kv_cache_report
from services.worker.spec.draft_model import DraftModelProposer
from services.worker.spec.ngram import NgramProposer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_STEP_TIME_S = 60.0
MAX_LIGHT_TENANT_PREFILL_RATIO = 100.0


@dataclass
class BuiltEngine:
    engine: LLMEngine
    loaded: LoadedModel
    device: torch.device
    dtype: torch.dtype
    parallel: TensorParallelWorkers | None = None   # ranks 1..N-1 of a tensor-parallel worker

    @property
    def dtype_name(self) -> str:
        """The model's dtype as configs name it ("auto" resolved): what the worker reports."""
        return dtype_name(self.dtype)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, quantization: str = "none") -> torch.dtype:
    """name "auto": bfloat16 on a GPU that has it (else float16) and on a CPU with bfloat16 matrix
    units; float32 on other CPUs, where bfloat16 is emulated, and under int8 weights, whose
    products take float32 activations."""
    if name == "auto":
        if quantization != "none":
            return torch.float32
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if device.type == "cpu" and has_native_bfloat16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """engine.kv_cache_dtype: auto is the model's dtype; a named one must be no wider (a wider
    cache would cost memory and keep no more than the model computed)."""
    if name == "auto":
        return model_dtype
    if name not in DTYPES:
        raise ValueError(f"unknown engine.kv_cache_dtype {name!r}; expected auto or one of {sorted(DTYPES)}")
    dtype = DTYPES[name]
    if dtype.itemsize > model_dtype.itemsize:
        raise ValueError(f"engine.kv_cache_dtype {name} is wider than the model's {dtype_name(model_dtype)}: "
                         f"use auto or a narrower type")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def build_engine(model_cfg: ModelSourceConfig, engine_cfg: EngineConfig,
                 loaded: LoadedModel | None = None, draft: LoadedModel | None = None) -> BuiltEngine:
    """loaded, draft: the target and draft models when already loaded (tests share them)."""
    if not 0 <= engine_cfg.max_step_time_s <= MAX_STEP_TIME_S:
        raise ValueError(f"engine.max_step_time_s must be in [0, {MAX_STEP_TIME_S:g}] seconds (0: no bound), "
                         f"got {engine_cfg.max_step_time_s}")
    if not 0 <= engine_cfg.light_tenant_prefill_ratio <= MAX_LIGHT_TENANT_PREFILL_RATIO:
        raise ValueError(f"engine.light_tenant_prefill_ratio must be in [0, {MAX_LIGHT_TENANT_PREFILL_RATIO:g}] (0: off), "
                         f"got {engine_cfg.light_tenant_prefill_ratio}")
    if engine_cfg.num_threads:
        torch.set_num_threads(engine_cfg.num_threads)
    parallel = start_tensor_parallel(model_cfg, engine_cfg)   # None at tensor_parallel_size 1
    try:
        return _build_engine(model_cfg, engine_cfg, loaded, draft, parallel)
    except BaseException:
        if parallel is not None:
            parallel.stop()
        raise


def _build_engine(model_cfg: ModelSourceConfig, engine_cfg: EngineConfig, loaded: LoadedModel | None,
                  draft: LoadedModel | None, parallel: TensorParallelWorkers | None) -> BuiltEngine:
    device = parallel.device if parallel is not None else resolve_device(model_cfg.device)
    if device.type == "cpu":
        keep_freed_memory()   # a CPU step's megabyte buffers stay mapped between steps
    dtype = resolve_dtype(model_cfg.dtype, device, model_cfg.quantization)
    kv_cache_dtype = resolve_kv_cache_dtype(engine_cfg.kv_cache_dtype, dtype)
    kv_dtype = dtype_name(kv_cache_dtype)
    attention = select_backend(engine_cfg.attention_backend, device)
    tp = parallel.tp if parallel is not None else SINGLE
    if loaded is None:
        loaded = load_model(model_cfg.source, dtype, device, attention, seed=model_cfg.seed,
                            quantization=model_cfg.quantization, tp=tp, pack_weights=model_cfg.pack_weights)
    draft = load_draft(engine_cfg, loaded, draft, dtype, device, attention, model_cfg)
    cfg = loaded.config
    local = kv_shape(cfg, tp)   # this rank's KV heads: the whole model's at size 1
    per_block = kv_bytes_per_token(local, kv_dtype) * engine_cfg.block_size
    if draft is not None:   # the draft's cache (the model's dtype) has as many blocks and shares the budget
        per_block += kv_bytes_per_token(draft.config, dtype_name(dtype)) * engine_cfg.block_size
    num_blocks = engine_cfg.num_blocks or int(engine_cfg.kv_cache_memory_gb * 2**30 // per_block)
    max_model_len = min(engine_cfg.max_model_len or cfg.max_context_length, cfg.max_context_length,
                        (num_blocks - 1) * engine_cfg.block_size,
                        draft.config.max_context_length if draft is not None else cfg.max_context_length)
    log.info(kv_cache_report(local, num_blocks, engine_cfg.block_size, kv_dtype, max_model_len=max_model_len))
    if parallel is not None:
        parallel.start(num_blocks)
    sampler = Sampler()
    drafter = DraftModelProposer(draft.model, num_blocks, engine_cfg.block_size, sampler) if draft is not None else None
    # Graphs need a backend that plans on the device; the PyTorch one plans from host lengths.
    # Tensor parallel steps broadcast their inputs first: no graphs there.
    graph_max_batch = min(engine_cfg.cuda_graph_max_batch, engine_cfg.max_num_seqs) \
        if attention.name == "triton" and parallel is None else 0
    model = loaded.model if parallel is None else parallel.driving(loaded.model)
    runner = ModelRunner(model, cfg.num_layers, local.num_kv_heads, cfg.head_dim, num_blocks,
                         engine_cfg.block_size, kv_cache_dtype, device, sampler, drafter=drafter,
                         max_model_len=max_model_len, graph_max_batch=graph_max_batch)
    limits = EngineLimits(max_model_len=max_model_len, block_size=engine_cfg.block_size, num_blocks=num_blocks,
                          max_num_seqs=engine_cfg.max_num_seqs,
                          max_num_batched_tokens=engine_cfg.max_num_batched_tokens,
                          enable_prefix_caching=engine_cfg.enable_prefix_caching,
                          max_step_time_s=engine_cfg.max_step_time_s,
                          light_tenant_prefill_ratio=engine_cfg.light_tenant_prefill_ratio,
                          sliding_window=releasable_window(cfg, draft) if engine_cfg.release_window_blocks else None)
    # A proposer is always there, so a request can ask for speculation on a worker whose
    # default k is 0 (a draft model therefore keeps its cache up to date in every step).
    proposer = None if drafter else NgramProposer(engine_cfg.ngram_min, engine_cfg.ngram_max)
    async_scheduling = engine_cfg.async_scheduling
    if async_scheduling is None:
        async_scheduling = device.type == "cuda" and parallel is None
    engine = LLMEngine(limits, runner, loaded.tokenizer, cfg.vocab_size, proposer=proposer,
                       num_speculative_tokens=engine_cfg.num_speculative_tokens,
                       async_scheduling=async_scheduling)
    return BuiltEngine(engine, loaded, device, dtype, parallel)


def releasable_window(cfg, draft: LoadedModel | None) -> int | None:
    """The window past which a request's blocks may return to the pool: only when every layer
    slides (Mistral's window, say; Gemma 3's global layers keep every block) and no draft model
    reads the same block tables over its whole context."""
    if draft is None and all(cfg.is_sliding(layer) for layer in range(cfg.num_layers)):
        return cfg.sliding_window
    return None


SPECULATIVE_METHODS = ("ngram", "draft_model")


def load_draft(engine_cfg: EngineConfig, target: LoadedModel, draft: LoadedModel | None, dtype: torch.dtype,
               device: torch.device, attention, model_cfg: ModelSourceConfig) -> LoadedModel | None:
    """The draft model for speculative_method draft_model (None for ngram), checked against the target."""
    method = engine_cfg.speculative_method
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"unknown speculative_method {method!r}; expected one of {', '.join(SPECULATIVE_METHODS)}")
    if method == "ngram":
        return None
    if draft is None:
        if not engine_cfg.draft_model:
            raise ValueError("speculative_method draft_model needs engine.draft_model: a .gguf path, "
                             "a Hugging Face folder, 'smollm2' or 'random:<shape>'")
        draft = load_model(engine_cfg.draft_model, dtype, device, attention, seed=model_cfg.seed,
                           pack_weights=model_cfg.pack_weights)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is not the target's "
                         f"({target.config.vocab_size}): they must share the tokenizer")
    log.info("draft model %s: %d layers, hidden size %d", draft.config.name, draft.config.num_layers,
             draft.config.hidden_size)
    return draft

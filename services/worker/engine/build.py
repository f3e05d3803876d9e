"""Assembles an engine from the worker's configuration: model, KV cache size, runner, sampler."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.worker.attention.backend import select_backend
from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.llm_engine import EngineLimits, LLMEngine
from services.worker.engine.model_runner import ModelRunner
from services.worker.engine.sampler import Sampler
from services.worker.model.loader import LoadedModel, load_model
from services.worker.sizing import kv_bytes_per_token, kv_cache_report
from services.worker.spec.ngram import NgramProposer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BuiltEngine:
    engine: LLMEngine
    loaded: LoadedModel
    device: torch.device
    dtype: torch.dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def build_engine(model_cfg: ModelSourceConfig, engine_cfg: EngineConfig,
                 loaded: LoadedModel | None = None) -> BuiltEngine:
    if engine_cfg.num_threads:
        torch.set_num_threads(engine_cfg.num_threads)
    device = resolve_device(model_cfg.device)
    dtype = resolve_dtype(model_cfg.dtype)
    attention = select_backend(engine_cfg.attention_backend, device)
    if loaded is None:
        loaded = load_model(model_cfg.source, dtype, device, attention, seed=model_cfg.seed)
    cfg = loaded.config
    per_block = kv_bytes_per_token(cfg, model_cfg.dtype) * engine_cfg.block_size
    num_blocks = engine_cfg.num_blocks or int(engine_cfg.kv_cache_memory_gb * 2**30 // per_block)
    max_model_len = min(engine_cfg.max_model_len or cfg.max_context_length, cfg.max_context_length,
                        (num_blocks - 1) * engine_cfg.block_size)
    log.info(kv_cache_report(cfg, num_blocks, engine_cfg.block_size, model_cfg.dtype, max_model_len=max_model_len))
    runner = ModelRunner(loaded.model, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks,
                         engine_cfg.block_size, dtype, device, Sampler())
    limits = EngineLimits(max_model_len=max_model_len, block_size=engine_cfg.block_size, num_blocks=num_blocks,
                          max_num_seqs=engine_cfg.max_num_seqs,
                          max_num_batched_tokens=engine_cfg.max_num_batched_tokens,
                          enable_prefix_caching=engine_cfg.enable_prefix_caching)
    # The proposer is always there, so a request can ask for speculation on a worker whose
    # default k is 0.
    if engine_cfg.speculative_method != "ngram":
        raise ValueError(f"speculative_method {engine_cfg.speculative_method!r} is not supported yet")
    proposer = NgramProposer()
    engine = LLMEngine(limits, runner, loaded.tokenizer, cfg.vocab_size, proposer=proposer,
                       num_speculative_tokens=engine_cfg.num_speculative_tokens)
    return BuiltEngine(engine, loaded, device, dtype)

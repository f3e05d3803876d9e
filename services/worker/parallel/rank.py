"""A tensor-parallel rank other than 0: its shard of the model, its share of the KV cache (the
same blocks as rank 0's, its own KV heads), and a loop running whatever rank 0 broadcasts.

It schedules nothing and samples nothing; it exits when rank 0 says STOP, and with an error
when a collective fails (rank 0 gone, or timed out), so no rank outlives the worker.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch

from services.worker.attention.backend import select_backend
from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.parallel.channel import StepChannel
from services.worker.parallel.step import FORWARD, LOGITS, NOOP, STOP, payload_size, unpack_forward

log = logging.getLogger("llmserve.worker.rank")


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to join the group and build its shard."""
    rank: int
    size: int
    device: str
    store_file: str
    backend: str
    timeout_s: float
    model: ModelSourceConfig
    engine: EngineConfig


def run_rank(spec: RankSpec) -> None:
    """The rank process's entry point (multiprocessing spawn target)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {spec.rank} %(name)s: %(message)s")
    try:
        _serve(spec)
    except Exception:
        log.exception("rank %d failed", spec.rank)
        sys.exit(1)


def _serve(spec: RankSpec) -> None:
    from services.worker.engine.build import resolve_dtype, resolve_kv_cache_dtype
    from services.worker.engine.model_runner import kv_cache_tensors
    from services.worker.model.loader import load_model
    from services.worker.parallel.driver import join_group
    from services.worker.parallel.group import local_kv_heads
    if spec.engine.num_threads:
        torch.set_num_threads(spec.engine.num_threads)
    device = torch.device(spec.device)
    dtype = resolve_dtype(spec.model.dtype, device, spec.model.quantization)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp, store = join_group(spec)
    loaded = load_model(spec.model.source, dtype, device, select_backend(spec.engine.attention_backend, device),
                        seed=spec.model.seed, tp=tp, pack_weights=spec.model.pack_weights)
    store.set(f"loaded/{tp.rank}", "1")
    num_blocks = int(store.get("num_blocks"))   # waits for rank 0's sizing (the store's timeout)
    c = loaded.config
    kv_caches = kv_cache_tensors(c.num_layers, local_kv_heads(c.num_kv_heads, tp.size), c.head_dim,
                                 num_blocks, spec.engine.block_size,
                                 resolve_kv_cache_dtype(spec.engine.kv_cache_dtype, dtype), device)
    store.set(f"ready/{tp.rank}", "1")
    log.info("rank %d of %d serving its shard of %s on %s (%d KV blocks)", tp.rank, tp.size, c.name, device,
             num_blocks)
    _loop(loaded.model, kv_caches, StepChannel(comm_device(spec.backend, device)), spec.engine.block_size,
          device, dtype)


@torch.inference_mode()
def _loop(model, kv_caches, channel: StepChannel, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
    while True:
        head = channel.receive_header()
        kind = head[0]
        if kind == STOP:
            return
        if kind == FORWARD:
            payload = channel.receive((payload_size(head),), torch.long)
            ids, positions, meta = unpack_forward(head, payload.cpu(), block_size, device)
            model(ids, positions, kv_caches, meta)
        elif kind == LOGITS:
            rows = channel.receive((head[6], head[7]), dtype)
            model.compute_logits(rows.to(device))
        elif kind != NOOP:
            raise RuntimeError(f"unknown step message {kind}")


def comm_device(backend: str, device: torch.device) -> torch.device:
    """Where broadcast tensors live: NCCL moves CUDA tensors, gloo CPU ones."""
    return device if backend == "nccl" else torch.device("cpu")

"""Rank 0's side of a tensor-parallel worker: it spawns ranks 1..N-1, joins their group, and
drives them from the runner's one call site ("prepared forward inputs -> model forward ->
logits") through DrivingModel, which broadcasts each step's inputs before running its own shard.

Rank 0 runs the whole engine (scheduler, KV manager, sampler); the other ranks only repeat its
forward passes over their shard. Failure is final: a collective that raises (a rank died, or
timed out) or a rank process that exits makes every later call raise RankFailed (an EngineDead,
so the engine thread stops and its streams end with an error) and calls the failure callback
once (the worker turns NOT_SERVING and exits).

Start-up has no collective timeout to fit in (loading a shard can take minutes): the ranks meet
through the file store, with LOAD_TIMEOUT_S, and collectives begin once every rank is ready.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.async_engine import EngineDead
from services.worker.parallel.channel import StepChannel
from services.worker.parallel.group import TensorParallel
from services.worker.parallel.rank import RankSpec, comm_device, run_rank
from services.worker.parallel.step import LOGITS, NOOP, STOP, header, pack_forward

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 1800.0


class RankFailed(EngineDead):
    """The tensor-parallel group is broken: the worker cannot run another step."""


def join_group(spec: RankSpec) -> tuple[TensorParallel, dist.Store]:
    """Meet the other ranks in the file store, then form the process group whose collectives
    time out after spec.timeout_s. NCCL raises a timed-out collective only with blocking wait."""
    store = dist.FileStore(spec.store_file, spec.size)
    store.set_timeout(timedelta(seconds=LOAD_TIMEOUT_S))
    store.set(f"started/{spec.rank}", "1")
    store.wait([f"started/{r}" for r in range(spec.size)])
    if spec.backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    dist.init_process_group(spec.backend, store=dist.PrefixStore("group", store), rank=spec.rank,
                            world_size=spec.size, timeout=timedelta(seconds=spec.timeout_s))
    return TensorParallel(spec.rank, spec.size), store


class TensorParallelWorkers:
    def __init__(self, model_cfg: ModelSourceConfig, engine_cfg: EngineConfig, devices: list[str]):
        self.size, self.timeout_s = engine_cfg.tensor_parallel_size, engine_cfg.tensor_parallel_timeout_s
        self.backend = "nccl" if devices[0].startswith("cuda") else "gloo"
        self.device = torch.device(devices[0])   # rank 0's
        self._dir = tempfile.mkdtemp(prefix="llmserve-tp-")
        spec = lambda rank: RankSpec(rank, self.size, devices[rank], os.path.join(self._dir, "store"),  # noqa: E731
                                     self.backend, self.timeout_s, model_cfg, engine_cfg)
        context = multiprocessing.get_context("spawn")
        self.processes = [context.Process(target=run_rank, args=(spec(rank),), name=f"tp-rank-{rank}", daemon=True)
                          for rank in range(1, self.size)]
        for p in self.processes:
            p.start()
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._on_failure: Callable[[str], None] | None = None
        self._stopping = False
        self._last_message = time.monotonic()
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        if devices[0].startswith("cuda"):
            torch.cuda.set_device(torch.device(devices[0]))
        try:
            self.tp, self._store = join_group(spec(0))
        except BaseException:
            self._stopping = True
            for p in self.processes:
                p.terminate()
            raise
        self.channel = StepChannel(comm_device(self.backend, torch.device(devices[0])))

    def start(self, num_blocks: int) -> None:
        """Every rank allocates num_blocks KV blocks of its own heads; -> when all are ready."""
        self._store.set("num_blocks", str(num_blocks))
        keys = [f"ready/{r}" for r in range(1, self.size)]
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while True:   # in short waits, so a rank that died while loading is reported at once
            self._check()
            try:
                self._store.wait(keys, timedelta(seconds=1))
                break
            except RuntimeError:   # not yet (the store's wait raises on its timeout)
                if time.monotonic() > deadline:
                    raise RankFailed(f"tensor-parallel ranks not ready after {LOAD_TIMEOUT_S:.0f}s")
        threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()
        log.info("tensor parallel: %d ranks over %s ready (collective timeout %gs)", self.size, self.backend,
                 self.timeout_s)

    def driving(self, model) -> DrivingModel:
        return DrivingModel(model, self)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """callback(reason), called once from some thread when the group breaks (at once if it has)."""
        self._on_failure = callback
        if self._failure is not None:
            callback(self._failure)

    @property
    def failure(self) -> str | None:
        return self._failure

    @contextmanager
    def collective(self):
        """Hold the group for one message and its collectives; a failure inside breaks it for good."""
        self._check()
        with self._lock:
            self._check()
            try:
                yield
            except Exception as e:
                self._fail(f"a tensor-parallel collective failed: {e}")
                raise RankFailed(self._failure) from e
            finally:
                self._last_message = time.monotonic()

    def stop(self, timeout: float = 10.0) -> None:
        """STOP to the ranks, then wait for them (a failed group: terminate them)."""
        self._stopping = True
        if self._failure is None and self._lock.acquire(timeout=timeout):
            try:
                self.channel.send(header(STOP))
            except Exception:   # noqa: BLE001 - the ranks are stopped below either way
                log.warning("could not send STOP to the tensor-parallel ranks")
            finally:
                self._lock.release()
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
                p.join(timeout)
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _check(self) -> None:
        if self._failure is not None:
            raise RankFailed(self._failure)

    def _fail(self, reason: str) -> None:
        if self._failure is not None or self._stopping:
            return
        self._failure = reason
        log.error("tensor parallel group broken: %s", reason)
        if self._on_failure is not None:
            self._on_failure(reason)

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.processes}
        ready = multiprocessing.connection.wait(list(sentinels))
        p = sentinels[ready[0]]
        p.join()
        self._fail(f"{p.name} exited with code {p.exitcode}")

    def _heartbeat(self) -> None:
        """NOOPs while the engine is idle, so the ranks' waits for a step never time out."""
        interval = self.timeout_s / 4
        while not self._stopping and self._failure is None:
            time.sleep(interval)
            if time.monotonic() - self._last_message >= interval:
                try:
                    with self.collective():
                        self.channel.send(header(NOOP))
                except RankFailed:
                    return


class DrivingModel:
    """Rank 0's model: each call broadcasts its inputs, then runs rank 0's shard; every other
    attribute is the shard's (config, decode_weight_bytes, ...)."""

    def __init__(self, model, workers: TensorParallelWorkers):
        self.model, self.workers = model, workers

    def __call__(self, input_ids, positions, kv_caches, meta):
        with self.workers.collective():
            self.workers.channel.send(*pack_forward(input_ids, positions, meta))
            return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.workers.collective():
            self.workers.channel.send(header(LOGITS, 0, 0, 0, 0, 0, *hidden.shape), hidden)
            return self.model.compute_logits(hidden)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def start_tensor_parallel(model_cfg: ModelSourceConfig, engine_cfg: EngineConfig) -> TensorParallelWorkers | None:
    """None at tensor_parallel_size 1. Otherwise checks the size against the devices, the options
    and the model's shape (ValueError naming what is wrong, before anything is spawned), then
    starts ranks 1..N-1 and joins their group."""
    from services.worker.model.loader import read_checkpoint
    from services.worker.parallel.validate import check_engine_options, check_shardable, tensor_parallel_devices
    devices = tensor_parallel_devices(model_cfg, engine_cfg, torch.cuda.device_count())
    if engine_cfg.tensor_parallel_size == 1:
        return None
    check_engine_options(model_cfg, engine_cfg)
    check_shardable(read_checkpoint(model_cfg.source).config, engine_cfg.tensor_parallel_size)
    return TensorParallelWorkers(model_cfg, engine_cfg, devices)


def kv_shape(config, tp: TensorParallel):
    """The config as this rank's KV cache sees it (its KV heads), for sizing the cache."""
    from dataclasses import replace
    from services.worker.parallel.group import local_kv_heads
    return replace(config, num_kv_heads=local_kv_heads(config.num_kv_heads, tp.size))

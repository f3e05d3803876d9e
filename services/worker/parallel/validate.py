"""What a tensor-parallel worker checks at start, before it spawns a rank: the size against the
devices, and the model's shape against the size (every split must come out whole)."""

from __future__ import annotations

from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.model.config import ModelConfig


def tensor_parallel_devices(model_cfg: ModelSourceConfig, engine_cfg: EngineConfig, cuda_devices: int) -> list[str]:
    """The device of each rank: engine.devices (comma-separated) when set, else cuda:0..N-1 on a
    CUDA worker (model.device auto with GPUs, cuda or cuda:N) and the CPU for every rank otherwise.
    Raises ValueError for a size below 1 or above the devices there are."""
    size = engine_cfg.tensor_parallel_size
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"engine.tensor_parallel_size must be a positive integer, got {size!r}")
    if engine_cfg.devices:
        devices = [d.strip() for d in engine_cfg.devices.split(",") if d.strip()]
        where = f"engine.devices lists {len(devices)} ({engine_cfg.devices})"
    elif model_cfg.device.startswith("cuda") or (model_cfg.device == "auto" and cuda_devices):
        devices = [f"cuda:{i}" for i in range(cuda_devices)]
        where = f"this machine has {cuda_devices} CUDA devices"
    else:
        return ["cpu"] * size
    if size > len(devices):
        raise ValueError(f"engine.tensor_parallel_size {size} exceeds the devices: {where}")
    if len(set(devices[:size])) < size:
        raise ValueError(f"engine.devices {engine_cfg.devices!r}: each rank needs a device of its own")
    return devices[:size]


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raises ValueError naming the first dimension `size` ranks cannot split evenly."""
    if size == 1:
        return
    kv = config.num_kv_heads
    dims = [("attention heads", config.num_heads), ("MLP intermediate size", config.intermediate_size),
            ("vocabulary", config.vocab_size)]
    if config.num_experts:
        dims.append(("expert intermediate size", config.moe_intermediate_size))
    for what, n in dims:
        if n % size:
            raise ValueError(f"engine.tensor_parallel_size {size} does not divide the {what} of "
                             f"{config.name} ({n})")
    if kv % size and size % kv:
        raise ValueError(f"engine.tensor_parallel_size {size} and the {kv} KV heads of {config.name}: "
                         f"one must divide the other (KV heads are split, or replicated when fewer)")


def check_engine_options(model_cfg: ModelSourceConfig, engine_cfg: EngineConfig) -> None:
    """Options the tensor-parallel worker does not support (yet), refused by name."""
    if engine_cfg.tensor_parallel_size == 1:
        return
    if model_cfg.quantization != "none":
        raise ValueError(f"model.quantization {model_cfg.quantization!r} is not supported with "
                         f"engine.tensor_parallel_size > 1")
    if engine_cfg.speculative_method == "draft_model":
        raise ValueError("speculative_method draft_model is not supported with engine.tensor_parallel_size > 1 "
                         "(n-gram speculation is)")

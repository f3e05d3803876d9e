"""Copies between host and device that never make the host wait for the device's queue.

With overlap (async scheduling) the host prepares step N+1 while the device runs step N, so
nothing on the step's path may synchronise: on CUDA a plain `.to(device)` of pageable memory
waits for the stream (every kernel queued before it), and `.tolist()` waits for everything queued
so far, step N+1 included. Inputs therefore go up from pinned memory without blocking, and a
step's outputs come down into pinned memory as soon as they are queued, behind an event that
only the collector waits on. On the CPU both are the identity.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def to_device(a: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array on device, queued behind the stream's work without waiting for it."""
    t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)   # its own pinned copy: a is free at once


def tensor_on(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device), without a synchronising copy."""
    return to_device(torch.tensor(values, dtype=dtype), device)


class HostCopy:
    """Device tensors on their way to the host: the copies are queued now, behind the work that
    makes them; get() waits for them alone (not for anything queued later)."""

    def __init__(self, tensors: Sequence[torch.Tensor | None]) -> None:
        self._event = None
        if any(t is not None and t.device.type == "cuda" for t in tensors):
            self._host = [None if t is None else _pinned_copy(t) for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = list(tensors)

    def get(self) -> list[torch.Tensor | None]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host

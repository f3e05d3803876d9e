"""Broadcasts of step messages from rank 0, and the rank processes' side of them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from services.worker.parallel.step import HEADER


class StepChannel:
    """Header then payload, broadcast from rank 0 over the group. Tensors travel through
    `device` (CUDA for NCCL, the CPU for gloo)."""

    def __init__(self, device: torch.device):
        self.device = device

    def send(self, head: torch.Tensor, payload: torch.Tensor | None = None) -> None:
        dist.broadcast(head.to(self.device), src=0)
        if payload is not None:
            dist.broadcast(payload.to(self.device).contiguous(), src=0)

    def receive_header(self) -> list[int]:
        head = torch.empty(HEADER, dtype=torch.long, device=self.device)
        dist.broadcast(head, src=0)
        return head.tolist()

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        payload = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(payload, src=0)
        return payload

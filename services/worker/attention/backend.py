"""The interface between the model and its attention kernels.

A backend writes the new keys and values into their cache slots and computes attention of the
new queries over each sequence's paged context: the whole causal context, or with a sliding
window of W only the last W positions up to and including the query's own (a query at position
p sees p - W + 1 .. p, transformers' `kv_idx > q_idx - sliding_window`). The window is a
per-layer argument (Gemma 3 mixes sliding and global layers; every layer shares one metadata).
The PyTorch backend is the reference; the CPU backend runs decode rows in a C kernel and the
rest as the reference does; the Triton backend is the GPU path. Both must match the reference. Neither reads cache blocks that lie wholly before the window of a sequence's
first query row, so such blocks may be reused by other sequences.
"""

from __future__ import annotations

from typing import Protocol

import torch

from services.worker.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key, value: [num_tokens, num_kv_heads, head_dim] into the slots of slot_mapping."""

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim];
        window: sliding-window size W >= 1, or None for full causal attention."""


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """'auto' picks Triton on CUDA and the CPU backend elsewhere (which keeps to the reference
    where its kernel cannot be built)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "cpu":
        from services.worker.attention.cpu.backend import CpuPagedAttention
        return CpuPagedAttention()
    if name == "torch":
        from services.worker.attention.torch_paged import TorchPagedAttention
        return TorchPagedAttention()
    if name == "triton":
        from services.worker.attention.triton.backend import TritonPagedAttention
        return TritonPagedAttention()
    raise ValueError(f"unknown attention backend {name!r} (auto, cpu, torch, triton)")

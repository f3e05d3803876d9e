"""Packed token bitmasks (bit t % 32 of word t // 32 set = token t allowed), applied to logits."""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmasks: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf wherever bitmasks[i] forbids token t. bitmasks [len(rows), words]."""
    vocab_size = logits.shape[1]
    bits = (bitmasks.to(logits.device)[:, :, None] >> _SHIFTS.to(logits.device)) & 1
    forbidden = bits.flatten(1)[:, :vocab_size] == 0
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))

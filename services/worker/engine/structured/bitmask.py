"""Packed token bitmasks (bit t % 32 of word t // 32 set = token t allowed), applied to logits."""

from __future__ import annotations

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmasks: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf wherever bitmasks[i] forbids token t. bitmasks [len(rows), words],
    int32 on the CPU (where grammar engines write them); unpacked there, little-endian words."""
    vocab_size = logits.shape[1]
    bits = np.unpackbits(bitmasks.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    forbidden = torch.from_numpy(bits == 0).to(logits.device)
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))

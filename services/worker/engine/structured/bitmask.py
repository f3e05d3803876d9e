"""Grammar masks as additive logit biases: 0 where a token is allowed, -inf where it is not.

Grammar engines write packed bitmasks (bit t % 32 of word t // 32 set = token t allowed); they are
unpacked into a bias row on the helper thread that computes them, so the engine thread only adds
one dense row per constrained logit row (a vectorised add; a boolean masked_fill over the
vocabulary was ~250x slower on this CPU). The logits a bias is added to never hold +inf, so a
sum is -inf exactly where the grammar forbids the token.
"""

from __future__ import annotations

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def bitmask_to_bias(bitmasks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] (little-endian words, on the CPU) -> float32 [rows, vocab_size] of 0 / -inf."""
    bits = np.unpackbits(bitmasks.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(np.where(bits, np.float32(0.0), np.float32(-np.inf)))

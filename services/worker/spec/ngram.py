"""Prompt-lookup decoding: propose the tokens that followed the last earlier occurrence of the
context's suffix. Free to compute and good on inputs that repeat themselves (code edits, quotes,
summaries, structured output)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix of token_ids (max_n down to min_n tokens)
        at its most recent earlier occurrence; [] when no suffix of min_n tokens recurs.

        One vectorised pass over the context for the last token, then checks on the surviving
        candidates only: O(len(token_ids)) per call.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        tokens = np.asarray(token_ids, dtype=np.int64)
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be one-dimensional, got shape {tokens.shape}")
        if k == 0 or len(tokens) <= self.min_n:
            return []
        last = len(tokens) - 1
        # Candidates are the end positions of earlier occurrences; the suffix itself ends at `last`.
        candidates = np.flatnonzero(tokens[:last] == tokens[last])
        matched, best = 1, candidates
        for n in range(2, self.max_n + 1):
            candidates = candidates[candidates >= n - 1]
            candidates = candidates[tokens[candidates - (n - 1)] == tokens[last - (n - 1)]]
            if len(candidates) == 0:
                break
            matched, best = n, candidates
        if matched < self.min_n or len(best) == 0:
            return []
        start = int(best[-1]) + 1
        return tokens[start:start + k].tolist()

"""How many draft tokens to verify for a request, from how well its drafts fared so far.

A rejected draft still costs its verification: k + 1 query rows instead of one. On text the
proposer cannot predict, drafts keep failing, so the draft length shrinks with the request's
acceptance rate (an exponential moving average), and below a floor speculation pauses for a few
steps before probing again with one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil


@dataclass
class AdaptiveDraftLength:
    smoothing: float = 0.5     # weight of the newest step in the moving average
    pause_below: float = 0.2   # acceptance under this pauses speculation
    pause_steps: int = 8

    acceptance: float = 1.0    # optimistic start: the first drafts are tried at full length
    paused: int = 0

    def next_k(self, k_max: int) -> int:
        if self.paused:
            self.paused -= 1
            return 0
        return max(1, min(k_max, ceil(k_max * self.acceptance)))

    def record(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        rate = accepted / proposed
        self.acceptance = (1 - self.smoothing) * self.acceptance + self.smoothing * rate
        if self.acceptance < self.pause_below:
            self.paused = self.pause_steps
            self.acceptance = self.pause_below   # probe again with a short draft after the pause

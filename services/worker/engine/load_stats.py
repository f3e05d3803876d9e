"""What the engine reports for admission: its step time as a function of the batch, recent speeds,
and the prompt work queued.

Every executed step is a sample (sequences in it, prompt tokens it computed, wall time). A least
squares fit over the samples, older ones decayed, gives step = base + per_seq x sequences +
per_prefill_token x prompt tokens: the speed one more stream would get is 1 / (base + per_seq x
(running + 1)). While the samples do not vary enough to tell the terms apart (every step the same
batch, say), a term falls back to a prior: each further sequence costs PRIOR_PER_SEQ of a batch-1
step (decode reads the weights once for the whole batch), a prompt token what the recent prefill
rate says. Moving averages (ALPHA) of the step time, of what one stream gets, and of the prefill
rate are reported beside the fit. An idle engine keeps its last figures: they describe the engine
when the next request comes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from services.worker.engine.scheduler import ScheduledRequest, Scheduler

ALPHA = 0.1
DECAY = 0.99               # weight of older samples in the fit, per step
PRIOR_PER_SEQ = 0.1
MIN_SPREAD = (0.25, 4.0)   # variance the sequences and the prompt tokens need before they are fitted


@dataclass(frozen=True)
class LoadSnapshot:
    waiting_prompt_tokens: int = 0   # prompt tokens of waiting and prefilling requests not yet computed
    step_time_s: float = 0.0         # 0 until a step has run
    decode_tokens_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_step_base_s: float = 0.0  # the fit; 0 until a step has run
    decode_step_per_seq_s: float = 0.0


def _ewma(old: float, new: float) -> float:
    return new if old == 0.0 else old + ALPHA * (new - old)


class _StepFit:
    """Decayed normal equations of y = c0 + c1 x1 + c2 x2."""

    def __init__(self) -> None:
        self.m = [[0.0] * 3 for _ in range(3)]
        self.v = [0.0] * 3

    def add(self, x1: float, x2: float, y: float) -> None:
        row = (1.0, x1, x2)
        for i in range(3):
            self.v[i] = self.v[i] * DECAY + row[i] * y
            for j in range(3):
                self.m[i][j] = self.m[i][j] * DECAY + row[i] * row[j]

    def solve(self, prefill_rate: float) -> tuple[float, float, float] | None:
        n = self.m[0][0]
        if n == 0:
            return None
        mean = [self.m[0][i] / n for i in range(3)]
        spread = [self.m[i][i] / n - mean[i] ** 2 for i in (1, 2)]
        fitted = [i for i, s in zip((1, 2), spread) if s >= MIN_SPREAD[i - 1]]
        fixed = {k: 0.0 for k in (1, 2) if k not in fitted}
        if 2 in fixed and prefill_rate > 0:
            fixed[2] = 1 / prefill_rate
        active = [0] + fitted
        # Move the fixed terms to the right-hand side and solve the rest (Gaussian elimination).
        a = [[self.m[i][j] for j in active] for i in active]
        b = [self.v[i] - sum(self.m[i][k] * c for k, c in fixed.items()) for i in active]
        coef = _solve(a, b)
        if coef is None:
            return None
        c = fixed | dict(zip(active, coef))
        if 1 not in fitted:   # one batch size B: c0 is the step at B; PRIOR_PER_SEQ of s1 per sequence
            s1 = c[0] / (1 + PRIOR_PER_SEQ * (mean[1] - 1))
            c[1] = PRIOR_PER_SEQ * s1
            c[0] = s1 - c[1]
        if c[0] <= 0 or c[1] < 0 or c[2] < 0:
            return None
        return c[0], c[1], c[2]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(n)]


class LoadStats:
    def __init__(self) -> None:
        self._step_s = 0.0
        self._decode_step_s = 0.0
        self._prefill_rate = 0.0
        self._fit = _StepFit()

    def record(self, scheduled: Iterable[ScheduledRequest], duration_s: float) -> None:
        """One executed step: what it computed and how long it took."""
        if duration_s <= 0:
            return
        seqs = decodes = prefill = 0
        for item in scheduled:
            seqs += 1
            known = item.num_known_tokens
            if item.samples and known == 1:
                decodes += 1
            else:
                prefill += known
        self._fit.add(seqs, prefill, duration_s)
        self._step_s = _ewma(self._step_s, duration_s)
        if decodes:
            self._decode_step_s = _ewma(self._decode_step_s, duration_s)
        if prefill:
            self._prefill_rate = _ewma(self._prefill_rate, prefill / duration_s)

    def snapshot(self, scheduler: Scheduler) -> LoadSnapshot:
        queued = sum(r.num_tokens for r in scheduler.waiting)
        queued += sum(r.num_tokens - 1 - r.num_computed_tokens for r in scheduler.running
                      if r.num_computed_tokens < r.num_tokens - 1)
        fit = self._fit.solve(self._prefill_rate)
        base, per_seq, per_token = fit or (0.0, 0.0, 0.0)
        return LoadSnapshot(waiting_prompt_tokens=queued, step_time_s=self._step_s,
                            decode_tokens_per_s=1.0 / self._decode_step_s if self._decode_step_s else 0.0,
                            prefill_tokens_per_s=1.0 / per_token if per_token > 0 else self._prefill_rate,
                            decode_step_base_s=base, decode_step_per_seq_s=per_seq)

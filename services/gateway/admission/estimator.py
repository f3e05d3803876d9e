"""What a model's pool can serve, from its workers' load reports.

A worker's decode step time grows with its batch: step(B) = base + per_seq x B, fitted here from
the (running streams, 1 / per-stream decode speed) pairs the reports carry (least squares with
decay, so the fit follows the machine). Until the reports span at least two batch sizes the slope
is a prior fraction of the step time (PRIOR_PER_SEQ), a memory-bound decode's shape. From it:
- streams a worker can run while each still gets the speed target: the largest B with
  1 / step(B) >= target, at most the engine's max_num_seqs;
- a new request's time to first token: the prompt tokens queued ahead of it (reported by the
  workers, plus what this gateway admitted since their report) over the pool's prefill rate,
  plus its own prefill and one step.
Workers of one pool run the same model on the same kind of machine: one fit serves them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from llmserve.v1 import worker_pb2

PRIOR_PER_SEQ = 0.1     # share of a batch-1 step each further stream adds, before the fit knows
DECAY = 0.98            # weight of older samples, per sample


@dataclass(frozen=True)
class PoolState:
    """One model's routable workers, summed from their last reports."""
    workers: int = 0
    running: int = 0
    waiting: int = 0
    waiting_prompt_tokens: int = 0
    max_num_seqs: int = 0            # summed running caps
    prefill_tokens_per_s: float = 0.0  # summed
    decode_tokens_per_s: float = 0.0   # per stream, mean over workers that decode
    step_time_s: float = 0.0

    @property
    def measured(self) -> bool:
        """Whether the workers have run steps, so speeds are known."""
        return self.decode_tokens_per_s > 0

    @classmethod
    def of(cls, reports: Sequence[worker_pb2.LoadReport]) -> "PoolState":
        speeds = [r.decode_tokens_per_s for r in reports if r.decode_tokens_per_s > 0]
        steps = [r.step_time_s for r in reports if r.step_time_s > 0]
        return cls(workers=len(reports), running=sum(r.running for r in reports),
                   waiting=sum(r.waiting for r in reports),
                   waiting_prompt_tokens=sum(r.waiting_prompt_tokens for r in reports),
                   max_num_seqs=sum(r.max_num_seqs for r in reports),
                   prefill_tokens_per_s=sum(r.prefill_tokens_per_s for r in reports),
                   decode_tokens_per_s=sum(speeds) / len(speeds) if speeds else 0.0,
                   step_time_s=sum(steps) / len(steps) if steps else 0.0)


class StepModel:
    """step(B) = base + per_seq x B for one pool's workers, from (B, step time) samples."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, batch: float, step_s: float) -> None:
        if batch <= 0 or step_s <= 0 or not math.isfinite(step_s):
            return
        self._w = self._w * DECAY + 1
        self._x = self._x * DECAY + batch
        self._y = self._y * DECAY + step_s
        self._xx = self._xx * DECAY + batch * batch
        self._xy = self._xy * DECAY + batch * step_s

    def line(self) -> tuple[float, float] | None:
        """(base, per_seq) in seconds, or None before any sample."""
        if self._w == 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var >= 0.25:   # at least two batch sizes seen
            slope = (self._xy / self._w - mx * my) / var
            if slope > 0:
                base = my - slope * mx
                if base > 0:
                    return base, slope
        # One batch size (or noise): a batch-1 step s1 with s1 x PRIOR_PER_SEQ per further stream.
        s1 = my / (1 + PRIOR_PER_SEQ * (mx - 1))
        return s1 * (1 - PRIOR_PER_SEQ), s1 * PRIOR_PER_SEQ

    def step_s(self, batch: float) -> float | None:
        fit = self.line()
        return None if fit is None else fit[0] + fit[1] * max(1.0, batch)

    def streams_at(self, tokens_per_s: float) -> int | None:
        """The most streams one worker runs with each at tokens_per_s or faster (at least 1)."""
        fit = self.line()
        if fit is None:
            return None
        if tokens_per_s <= 0:
            return 1 << 20
        base, per_seq = fit
        return max(1, int((1 / tokens_per_s - base) / per_seq + 1e-6))


@dataclass(frozen=True)
class Estimate:
    ttft_s: float
    tokens_per_s: float


class PoolEstimator:
    """One model's pool: its last state and the step-time fit across reports."""

    def __init__(self) -> None:
        self.state = PoolState()
        self.steps = StepModel()

    def update(self, reports: Sequence[worker_pb2.LoadReport]) -> None:
        self.state = PoolState.of(reports)
        for r in reports:
            if r.decode_tokens_per_s > 0 and r.running > 0:
                self.steps.observe(r.running, 1 / r.decode_tokens_per_s)

    def capacity(self, tokens_per_s: float) -> int | None:
        """Streams the whole pool runs at the speed target; None before the workers measured."""
        s = self.state
        per_worker = self.steps.streams_at(tokens_per_s) if s.measured else None
        if per_worker is None:
            return None
        cap = per_worker * s.workers
        return min(cap, s.max_num_seqs) if s.max_num_seqs else cap

    def queue_delay_s(self, extra_prompt_tokens: int = 0) -> float:
        """How long prompts already queued keep a new one from its prefill (0 when unknown)."""
        s = self.state
        if s.prefill_tokens_per_s <= 0:
            return 0.0
        return (s.waiting_prompt_tokens + extra_prompt_tokens) / s.prefill_tokens_per_s

    def estimate(self, prompt_tokens: int, streams: int, extra_prompt_tokens: int = 0) -> Estimate | None:
        """A new request's first token and stream speed if it joined `streams` running ones."""
        s = self.state
        if not s.measured or s.prefill_tokens_per_s <= 0:
            return None
        per_worker = max(1.0, (streams + 1) / max(1, s.workers))
        step = self.steps.step_s(per_worker)
        prefill = prompt_tokens / (s.prefill_tokens_per_s / max(1, s.workers))
        return Estimate(ttft_s=self.queue_delay_s(extra_prompt_tokens) + prefill + step,
                        tokens_per_s=1 / step)

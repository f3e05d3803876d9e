"""What the engine reports for admission: its decode step time as a function of the batch, recent
speeds, and the prompt work queued.

Every executed step is a sample (sequences in it, prompt tokens it computed, wall time). The
decode line, step = base + per_seq x sequences, is a least-squares fit over the steps that only
decode (older ones decayed): the speed one more stream would get is 1 / (base + per_seq x (running
+ 1)). Steps that prefill are kept out of it. In a burst's first 20-30 s nearly every step
prefills, and a fit over all steps (with a term per prompt token) put the prompts' time into base
and per_seq: bench-load's float32 worker reported 0.27 s + 0.06 s a sequence, 3 streams at 2
tokens/s, while its decode steps took about 0.2 s at 32; the gateway's limit followed it down
and refused queued requests. A prefilling step's time less the decode line's share at its
decoding sequences is its prompt tokens', which gives the prefill rate (decayed sums of tokens
over seconds). While the decode steps do not vary enough to tell base from per_seq (every step
the same batch, say), or the noise bends the fit below zero, each further sequence costs
PRIOR_PER_SEQ of a batch-1 step (decode reads the weights once for the whole batch). Moving
averages (ALPHA) of the step time and of what one stream gets (prefill included) are reported
beside, and the share of the last PREFILL_SHARE_WINDOW_S seconds of wall time that prompts took
(decayed by wall time, so an idle gap counts as time without prompts from the next step on):
under steady arrivals, what their prefills take from every stream's decode steps, which the
gateway's capacity must leave room for (bench-load's open loop at 2x-4x: a limit from the decode
line alone gave streams 1.3-1.7 tokens/s against a 2 tokens/s target). An idle engine keeps its
last figures: they describe the engine when the next request comes; one that has not run a
decode-only step yet reports no line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from services.worker.engine.scheduler import ScheduledRequest, Scheduler

ALPHA = 0.1
DECAY = 0.99               # weight of older decode steps in the line, per decode step
PREFILL_DECAY = 0.9        # weight of older prefilling steps in the prefill rate, per such step
PRIOR_PER_SEQ = 0.1
MIN_SPREAD = 0.25          # variance of the batch sizes the line needs before its slope is fitted
MIN_PROMPT_BUDGET = 64     # prompt tokens a step takes however long its decodes: queued prompts still move
PREFILL_SHARE_WINDOW_S = 10.0   # time constant of the prefill share


@dataclass(frozen=True)
class LoadSnapshot:
    waiting_prompt_tokens: int = 0   # prompt tokens of waiting and prefilling requests not yet computed
    step_time_s: float = 0.0         # 0 until a step has run
    decode_tokens_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_step_base_s: float = 0.0  # the decode line; 0 until a decode-only step has run
    decode_step_per_seq_s: float = 0.0
    prefill_time_share: float = 0.0  # of the recent wall time, 0-1


def _ewma(old: float, new: float) -> float:
    return new if old == 0.0 else old + ALPHA * (new - old)


class _LineFit:
    """Decayed least squares of y = base + per_seq x."""

    def __init__(self) -> None:
        self.n = self.sx = self.sxx = self.sy = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        self.n = self.n * DECAY + 1.0
        self.sx = self.sx * DECAY + x
        self.sxx = self.sxx * DECAY + x * x
        self.sy = self.sy * DECAY + y
        self.sxy = self.sxy * DECAY + x * y

    def solve(self) -> tuple[float, float] | None:
        """(base, per_seq), or None before any sample."""
        if self.n == 0:
            return None
        mx, my = self.sx / self.n, self.sy / self.n
        spread = self.sxx / self.n - mx * mx
        if spread >= MIN_SPREAD:
            per_seq = (self.sxy / self.n - mx * my) / spread
            base = my - per_seq * mx
            if base > 0 and per_seq >= 0:
                return base, per_seq
        s1 = my / (1 + PRIOR_PER_SEQ * (mx - 1))   # the prior: the mean step at the mean batch
        return s1 * (1 - PRIOR_PER_SEQ), s1 * PRIOR_PER_SEQ


class LoadStats:
    def __init__(self) -> None:
        self._step_s = 0.0
        self._decode_step_s = 0.0
        self._decode_line = _LineFit()
        self._prefill_tokens = 0.0    # decayed sums over prefilling steps: tokens, and their seconds
        self._prefill_seconds = 0.0
        self._recent_prefill_s = 0.0  # prompt seconds, decayed by wall time (PREFILL_SHARE_WINDOW_S)
        self._recent_at: float | None = None

    def record(self, scheduled: Iterable[ScheduledRequest], duration_s: float, ended_at: float) -> None:
        """One executed step: what it computed, how long it took, and when it ended (monotonic s)."""
        if duration_s <= 0:
            return
        if self._recent_at is not None:
            self._recent_prefill_s *= math.exp(-max(0.0, ended_at - self._recent_at) / PREFILL_SHARE_WINDOW_S)
        self._recent_at = ended_at
        seqs = decodes = prefill = 0
        for item in scheduled:
            seqs += 1
            known = item.num_known_tokens
            if item.samples and known == 1:
                decodes += 1
            else:
                prefill += known
        self._step_s = _ewma(self._step_s, duration_s)
        if decodes:
            self._decode_step_s = _ewma(self._decode_step_s, duration_s)
        if not prefill:
            self._decode_line.add(seqs, duration_s)
            return
        line = self._decode_line.solve()
        decoding_s = line[0] + line[1] * decodes if line and decodes else 0.0
        prompt_s = max(0.0, duration_s - decoding_s)
        self._prefill_tokens = self._prefill_tokens * PREFILL_DECAY + prefill
        self._prefill_seconds = self._prefill_seconds * PREFILL_DECAY + prompt_s
        self._recent_prefill_s += prompt_s

    def prompt_budget(self, decoding: int, step_time_s: float = 0.0, decode_ratio: float = 0.0) -> int | None:
        """The prompt tokens a step beside `decoding` decodes takes: as many as still end it within
        step_time_s (what the decode line leaves), or else as add at most decode_ratio times the
        decodes' own time; at the measured prefill rate, and at least MIN_PROMPT_BUDGET. None
        while nothing decodes (nobody's pace to keep) or before both were measured."""
        line = self._decode_line.solve() if decoding else None
        if line is None or self._prefill_seconds <= 0:
            return None
        decode_s = line[0] + line[1] * decoding
        left_s = step_time_s - decode_s if step_time_s else decode_ratio * decode_s
        return max(MIN_PROMPT_BUDGET, int(left_s * self._prefill_tokens / self._prefill_seconds))

    def snapshot(self, scheduler: Scheduler) -> LoadSnapshot:
        queued = sum(r.num_tokens for r in scheduler.waiting)
        queued += sum(r.num_tokens - 1 - r.num_computed_tokens for r in scheduler.running
                      if r.num_computed_tokens < r.num_tokens - 1)
        base, per_seq = self._decode_line.solve() or (0.0, 0.0)
        return LoadSnapshot(waiting_prompt_tokens=queued, step_time_s=self._step_s,
                            decode_tokens_per_s=1.0 / self._decode_step_s if self._decode_step_s else 0.0,
                            prefill_tokens_per_s=self._prefill_tokens / self._prefill_seconds
                            if self._prefill_seconds > 0 else 0.0,
                            decode_step_base_s=base, decode_step_per_seq_s=per_seq,
                            prefill_time_share=min(1.0, self._recent_prefill_s / PREFILL_SHARE_WINDOW_S))

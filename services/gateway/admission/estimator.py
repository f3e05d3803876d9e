"""What a model's pool can serve, from its workers' load reports.

Each worker reports its decode step time fitted over its decode-only steps, step(B) = base +
per_seq x B for B sequences (services/worker/engine/load_stats.py); workers of one pool run the
same model on the same kind of machine, so their mean line serves the pool. From it:
- streams a worker runs while each still gets the speed target: the largest B with
  1 / step(B) >= target. Where even one stream misses the target (a slow or busy machine) the
  target cannot be met, and the worker runs KNEE_SHARE of its peak throughput's worth of streams
  instead: batching more then only slows everyone (the peak is 1 / per_seq tokens/s);
- in a standing queue (steady arrivals, not a burst), the same with the decode steps' share of the
  worker's time: prompts took the reported prefill share of the last seconds, and the next
  arrivals' take as much, so a stream gets (1 - share) / step(B). bench-load's open loop at 2x and
  4x capacity: the decode line alone kept the limit at 64 and streams got 1.3-1.7 tokens/s against
  a target of 2. A burst's prefill is left out: it happens once, and its streams decode at the
  line's speed afterwards;
- a new request's time to first token: the prompt tokens queued ahead of it (reported by the
  workers, plus what this gateway admitted since their report) drained beside the streams
  decoding, plus its own prefill and one step. Each step computes at most the token budget less
  its decodes, and takes the decode step on top of its prompt tokens' time: the reported rate is
  the prompt tokens' own, and a 2-core CPU worker beside 50 streams drains its queue at about
  half of it. Admission that counted the pure rate let a ramp's arrivals queue first tokens 2-4 s
  deep (bench-load's open loop at 4x, 12-05).

The capacity is the median over the lines reported in the last CAPACITY_WINDOW_S seconds, not the
last one: during a burst the fit swings with the mix of prefill and decode in its steps. Over the
last 9 reports (4.5 s at make run's polls) bench-load's int8 pool still went 36 -> 9 -> 36 streams
within 8 s and the float32 pool 64 -> 10 -> 31; the waits estimated under a dip refused 14 queued
requests, whose clients slept out their Retry-After while the pool sat idle for 26 s. A change that
lasts half the window moves the capacity.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from llmserve.v1 import worker_pb2

KNEE_SHARE = 0.8
MAX_PREFILL_SHARE = 0.9    # of the worker's time: past it a stream's speed is left to the floor of the limit
CAPACITY_WINDOW_S = 30.0   # the capacity is the median of the lines reported over this many seconds
MIN_CHUNK_TOKENS = 64      # prompt tokens a step takes however many decode (the worker's floor)


@dataclass(frozen=True)
class PoolState:
    """One model's routable workers, summed from their last reports."""
    workers: int = 0
    running: int = 0
    waiting: int = 0
    waiting_prompt_tokens: int = 0
    max_num_seqs: int = 0              # summed running caps
    max_num_batched_tokens: int = 0    # the smallest engine token budget per step
    prefill_tokens_per_s: float = 0.0  # summed
    prefill_time_share: float = 0.0    # the workers' mean

    @classmethod
    def of(cls, reports: Sequence[worker_pb2.LoadReport]) -> "PoolState":
        return cls(workers=len(reports), running=sum(r.running for r in reports),
                   waiting=sum(r.waiting for r in reports),
                   waiting_prompt_tokens=sum(r.waiting_prompt_tokens for r in reports),
                   max_num_seqs=sum(r.max_num_seqs for r in reports),
                   max_num_batched_tokens=min((r.max_num_batched_tokens for r in reports), default=0),
                   prefill_tokens_per_s=sum(r.prefill_tokens_per_s for r in reports),
                   prefill_time_share=sum(r.prefill_time_share for r in reports) / len(reports) if reports else 0.0)


@dataclass(frozen=True)
class StepLine:
    """step(B) = base + per_seq x B, in seconds."""
    base: float
    per_seq: float

    @classmethod
    def of(cls, reports: Sequence[worker_pb2.LoadReport]) -> "StepLine | None":
        """The mean of the workers' decode lines; None while none has run a decode-only step. No
        line is guessed from the speed streams got: before the first decode-only step that speed is
        a burst's prefill's (0.6 tokens/s at 29 streams in bench-load), and a line from it said 2-3
        streams where the worker ran 32 at 5 tokens/s a few seconds later."""
        fitted = [r for r in reports if r.decode_step_base_s > 0]
        if not fitted:
            return None
        return cls(sum(r.decode_step_base_s for r in fitted) / len(fitted),
                   sum(r.decode_step_per_seq_s for r in fitted) / len(fitted))

    def step_s(self, batch: float) -> float:
        return self.base + self.per_seq * max(1.0, batch)

    def streams_at(self, tokens_per_s: float, prefill_share: float = 0.0) -> int:
        """The most streams one worker runs with each at tokens_per_s while prompts take
        prefill_share of its time (see the module docstring)."""
        if tokens_per_s <= 0 or self.per_seq <= 0:
            return 1 << 20
        if 1 / self.step_s(1) < tokens_per_s:   # unreachable: the knee of the throughput curve
            return max(1, int(KNEE_SHARE / (1 - KNEE_SHARE) * self.base / self.per_seq))
        step = (1 - min(max(prefill_share, 0.0), MAX_PREFILL_SHARE)) / tokens_per_s
        return max(1, int((step - self.base) / self.per_seq + 1e-6))


@dataclass(frozen=True)
class Estimate:
    ttft_s: float
    tokens_per_s: float
    queue_s: float           # of ttft_s, the prompts queued ahead of it; the rest is its own prefill and a step


class PoolEstimator:
    """One model's pool: its workers' last reports, summed, and their step line."""

    def __init__(self) -> None:
        self.state = PoolState()
        self.line: StepLine | None = None
        self._lines: deque[tuple[float, StepLine, float]] = deque()   # (when, line, prefill share), oldest first

    def update(self, reports: Sequence[worker_pb2.LoadReport], now: float) -> None:
        """The workers' last reports, read at `now` (monotonic seconds)."""
        self.state = PoolState.of(reports)
        line = StepLine.of(reports)
        if line is not None:   # a pool gone quiet keeps its lines (an idle worker reports its last fit)
            self.line = line
            self._lines.append((now, line, self.state.prefill_time_share))
        while len(self._lines) > 1 and self._lines[0][0] <= now - CAPACITY_WINDOW_S:
            self._lines.popleft()

    def capacity(self, tokens_per_s: float, steady: bool = False) -> int | None:
        """Streams the whole pool runs at the speed target (the median of the recent reports'),
        beside the prompts of steady arrivals if `steady`; None before the workers measured."""
        s = self.state
        if not self._lines or not s.workers:
            return None
        cap = int(statistics.median(line.streams_at(tokens_per_s, share if steady else 0.0)
                                    for _, line, share in self._lines)) * s.workers
        return min(cap, s.max_num_seqs) if s.max_num_seqs else cap

    def queue_delay_s(self, extra_prompt_tokens: int = 0) -> float:
        """How long prompts already queued keep a new one from its prefill (0 when unknown)."""
        s = self.state
        if s.prefill_tokens_per_s <= 0:
            return 0.0
        return (s.waiting_prompt_tokens + extra_prompt_tokens) / s.prefill_tokens_per_s

    def drain_s(self, extra_prompt_tokens: int, streams: int) -> float:
        """How long the queued prompts take beside `streams` decoding: at the pure rate, plus one
        decode step for each chunk the budget leaves them (the module docstring). 0 when unknown."""
        s, delay = self.state, self.queue_delay_s(extra_prompt_tokens)
        workers = max(1, s.workers)
        per_worker = streams / workers
        if not delay or self.line is None or per_worker < 1 or not s.max_num_batched_tokens:
            return delay
        chunk = max(MIN_CHUNK_TOKENS, s.max_num_batched_tokens - per_worker)
        chunks = (s.waiting_prompt_tokens + extra_prompt_tokens) / workers / chunk
        return delay + chunks * self.line.step_s(per_worker)

    def estimate(self, prompt_tokens: int, streams: int, extra_prompt_tokens: int = 0) -> Estimate | None:
        """A new request's first token and stream speed if it joined `streams` running ones."""
        s = self.state
        if self.line is None or s.prefill_tokens_per_s <= 0:
            return None
        per_worker = max(1.0, (streams + 1) / max(1, s.workers))
        step = self.line.step_s(per_worker)
        prefill = prompt_tokens / (s.prefill_tokens_per_s / max(1, s.workers))
        queue = self.drain_s(extra_prompt_tokens, streams)
        return Estimate(ttft_s=queue + prefill + step, tokens_per_s=1 / step, queue_s=queue)

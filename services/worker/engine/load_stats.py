"""What the engine reports for admission: recent step times and speeds, and the prompt work queued.

Moving averages over recent steps (each step weighs ALPHA), kept by the engine thread:
- step_time_s: wall time of one step;
- decode_tokens_per_s: what one running stream gets, 1 / the mean time of steps that decode
  (prefill chunks sharing those steps slow them, and streams see that);
- prefill_tokens_per_s: prompt tokens computed per second of the steps that prefill.
An idle engine keeps its last figures: they describe the pool when the next request comes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from services.worker.engine.scheduler import ScheduledRequest, Scheduler

ALPHA = 0.1


@dataclass(frozen=True)
class LoadSnapshot:
    waiting_prompt_tokens: int = 0   # prompt tokens of waiting and prefilling requests not yet computed
    step_time_s: float = 0.0         # 0 until a step has run
    decode_tokens_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0


def _ewma(old: float, new: float) -> float:
    return new if old == 0.0 else old + ALPHA * (new - old)


class LoadStats:
    def __init__(self) -> None:
        self._step_s = 0.0
        self._decode_step_s = 0.0
        self._prefill_rate = 0.0

    def record(self, scheduled: Iterable[ScheduledRequest], duration_s: float) -> None:
        """One executed step: what it computed and how long it took."""
        if duration_s <= 0:
            return
        decodes = prefill = 0
        for item in scheduled:
            if item.samples and item.num_known_tokens == 1:
                decodes += 1
            else:
                prefill += item.num_known_tokens
        self._step_s = _ewma(self._step_s, duration_s)
        if decodes:
            self._decode_step_s = _ewma(self._decode_step_s, duration_s)
        if prefill:
            self._prefill_rate = _ewma(self._prefill_rate, prefill / duration_s)

    def snapshot(self, scheduler: Scheduler) -> LoadSnapshot:
        queued = sum(r.num_tokens for r in scheduler.waiting)
        queued += sum(r.num_tokens - 1 - r.num_computed_tokens for r in scheduler.running
                      if r.num_computed_tokens < r.num_tokens - 1)
        return LoadSnapshot(waiting_prompt_tokens=queued, step_time_s=self._step_s,
                            decode_tokens_per_s=1.0 / self._decode_step_s if self._decode_step_s else 0.0,
                            prefill_tokens_per_s=self._prefill_rate)

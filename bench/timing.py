"""Per-request token timing for the engine benchmarks: time to first token and the gaps after it."""

from __future__ import annotations

import time


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))]


class TokenTimeline:
    """Fed every engine step's outputs; arrival times default to when the timeline started."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.arrival: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.gaps: list[float] = []
        self.tokens = 0

    def observe(self, outputs) -> None:
        now = time.perf_counter()
        for o in outputs:
            if not o.token_ids:
                continue
            self.tokens += len(o.token_ids)
            if o.request_id in self.first:
                self.gaps.append(now - self.last[o.request_id])
            else:
                self.first[o.request_id] = now
            self.last[o.request_id] = now

    def ttfts(self, request_ids=None) -> list[float]:
        ids = self.first if request_ids is None else request_ids
        return [self.first[r] - self.arrival.get(r, self.start) for r in ids if r in self.first]

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

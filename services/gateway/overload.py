"""Admission: per model, as many streams as the pool serves within its targets, a short fair queue
behind them, and a fast refusal (429 or 503 with Retry-After) past that.

The limit of a model's streams follows the pool (set_pool, fed by pool_watch.py): once its workers
report speeds, the streams they can run while each gets overload.stream_tokens_per_s
(admission/estimator.py; in a standing queue, beside the arrivals' prefills); before that,
max_in_flight_per_worker x the routable workers (0: a fixed max_in_flight_per_model). Gateway
replicas share it: each takes 1/replicas, rounded up, within [min_in_flight_per_model,
max_in_flight_per_model]. A request is also held back while the prompt tokens queued in the pool
(reported, plus what this replica admitted since), drained beside the streams decoding, and its own
prefill would put its first token past the target (estimator.py; a long prompt's own prefill counts
at most half of it; the estimate is scaled by the 90th percentile of the recent first tokens'
measured / estimated times, as the target is a p95); a request alone in flight is never held back.
The target is overload.ttft_target_s, or, with overload.ttft_target_over_unloaded, that multiple of
the 95th percentile of the first tokens of the recent requests admitted to an idle pool
(_note_unloaded). An organization with nothing in flight is not kept waiting behind others' streams:
it may take one of a few slots past the limit (a quarter of it, at least one), so a light user stays
interactive during a flood; those are counted apart, so a flood's streams left above a limit that
fell do not use them up (admission/slot_release.py's `fits`).

Who waits goes first by priority class, then organization in weighted fair order by tokens
(admission/fair_queue.py). A request may wait a bounded time: queue_timeout_s while the pool is
absorbing a burst, but in a standing queue only what the target leaves past the measured time
from admission to first token, if its organization holds slots already and the fair order does not
need a waiter of it: under sustained overload, waiting longer only makes every first token late
(Facebook's controlled-delay queues, "Fail at Scale", use the same two bounds). A queue stands once
every newcomer has had to wait for queue_timeout_s on end, or sooner once arrivals outpace the slots
freed (sustained_window_s), and then holds those it took under the long bound to the short one too;
it lasts until nobody has been refused for sustained_window_s. A burst arrives at once
(overload.burst_share of the limit within half a second): a queue that formed without one (arrivals
filled the pool, or its prompt queue, over time) stands at once, unless only the pool's queued
prompts hold its newcomers back, with slots free and arrivals not outpacing the slots freed (Poisson
arrivals that clumped below capacity): those wait up to the target. A queue is judged a burst's
or not once it is half a second old; its newcomers until then wait the long bound (unless one
stands), and the short one from when they joined if it is not. A newcomer that waits over
burst_arrival_s after a burst's queue formed, when nobody who could wait the long bound was refused
since (so it is no burst's retry), is new load: the queue stands from then on, and the burst's
waiters keep their bounds. While a burst's queue is absorbed, only the slots hold its waiters back,
not the pool's queued prompts. A newcomer whose estimated wait exceeds its bound, or who finds the
queue full, is refused at once, with a Retry-After for when that wait would be half its bound (at
most 60 s, the most the openai SDK honours). The wait is read off the streams in flight
(admission/slot_release.py): each is expected to end at its grant + its answer budget at the
measured speed, or, once streaming, after what is left of its budget at its own pace, and a
waiter whose turn needs n slots freed waits for the n-th end (a replay of _wake on those ends),
not n x the mean hold / the limit; and until the prompts queued ahead of it,
the waiters' before it included, let its first token be planned within the target (as admission
plans it), whichever is later. The estimate of everyone waiting is renewed whenever it can change (a
slot freed, a new report, a first token of a prompt admitted here, a newcomer placed ahead by the
fair order): a waiter who can no longer be admitted within its bound is refused then, not when the
bound runs out. Nothing reaches the upstream before admission, so a refused request costs the pool
nothing.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections import Counter, deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Mapping, Sequence

from llmserve.v1 import worker_pb2
from services.gateway.admission.estimator import Estimate, PoolEstimator
from services.gateway.admission.fair_queue import FairQueue, Waiter, token_cost
from services.gateway.admission.metrics import AdmissionMetrics
from services.gateway.admission.slot_release import Slot, SlotReleases, fits
from services.gateway.config import OverloadConfig
from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics

HOLD_ALPHA = 0.2      # weight of the newest stream in the means of slot hold and first-token times
# The openai SDK ignores a Retry-After over 60 s and retries within a second or so: a longer estimate
# spent a burst's retries at once (bench-load on a fast VM: 14 of 32 refused in the end).
MAX_RETRY_AFTER_S = 60.0
OUTPACE = 1.5         # arrivals that find the pool full per slot freed that say the overload is sustained
OUTPACE_MIN = 4       # and at least this many of them in the window
# A burst: overload.burst_share of the limit, at least BURST_MIN requests, arriving within
# BURST_WINDOW_S. bench-load's burst of 32 chats arrives so; Poisson arrivals at 4x its capacity bring
# 4 in half a second, 16 in 2 s.
BURST_WINDOW_S = 0.5
BURST_MIN = 4
# The first-token target is a p95: admission plans with the 90th percentile of the last TTFT_ERRORS
# first tokens' measured / estimated times (once MIN_TTFT_ERRORS were measured), not the estimate alone.
TTFT_ERRORS = 64
MIN_TTFT_ERRORS = 16


class Overloaded(ApiError):
    """The model's pool is full and its queue too, or the wait would be too long; nothing was sent upstream."""


@dataclass(eq=False)
class Ticket:
    """One admitted request. first_token() lets the estimate be compared with what happened."""
    model: str
    org: str
    prompt_tokens: int
    admitted_at: float
    estimate: Estimate | None = None
    idle: bool = False                # admitted to an idle pool: its first token is an unloaded one
    grants_at: int = 0                # the model's grants counted when it was admitted (its own included)
    _guard: "OverloadGuard | None" = None
    _slot: Slot | None = None

    def first_token(self) -> None:
        guard = self._guard
        if guard is None or self._slot is None:
            return
        gate, now = guard._gate(self.model), guard.clock()
        if not gate.releases.first_token(self._slot, now):   # the slot's hold is its first token, then decode
            return
        gate.first_token_s = _mean(gate.first_token_s, now - self.admitted_at)
        if self.idle and gate.grants == self.grants_at:   # and nobody admitted beside it since
            guard._note_unloaded(self.model, gate, now - self.admitted_at)
        if self.estimate is not None:
            error = (now - self.admitted_at) / max(1e-3, self.estimate.ttft_s)
            guard.metrics.ttft_ratio.labels(model=self.model).observe(error)
            gate.ttft_errors.append(error)
            self.estimate = None
        if len(gate.queue):   # its prompt no longer holds the waiters back
            guard._wake(self.model, gate)

    def progress(self, tokens: int) -> None:
        """The stream has streamed `tokens` so far: when its slot frees is read off its pace."""
        if self._guard is not None and self._slot is not None:
            self._guard._gate(self.model).releases.progress(self._slot, tokens, self._guard.clock())


def _mean(mean: float, value: float) -> float:
    """The running mean with HOLD_ALPHA on the newest value (mean 0: none yet)."""
    return value if not mean else mean + HOLD_ALPHA * (value - mean)


def _turn(waiters: list[Waiter]) -> list[tuple[str, int, int]]:
    """The waiters' (organization, answer budget, prompt tokens), in their order, for _waits."""
    return [(w.org, w.answer_tokens, w.prompt_tokens) for w in waiters]


class _ModelGate:
    """Invariant: in_flight counts granted slots, including one granted to a waiter not yet resumed;
    releases holds one Slot for each of them."""

    def __init__(self, limit: int, window_s: float, ttft_target_s: float):
        self.limit = limit
        self.in_flight = 0
        self.grants = 0                       # slots granted so far
        self.queue = FairQueue()
        self.releases = SlotReleases()
        self.pool = PoolEstimator()
        self.since_report: list[Slot] = []    # granted since the last report, awaiting a first token
        self.org_in_flight: Counter[str] = Counter()
        self.hold_s = 0.0                     # mean time a stream holds its slot (0: none measured)
        self.expected_hold_s = 0.0            # the same from the estimates at admission (0: none made)
        self.first_token_s = 0.0              # mean time from admission to first token (0: none measured)
        self.contended_since: float | None = None   # since when every newcomer has had to wait
        self.standing = False                 # a standing queue: the short wait bound applies
        self.refused_at = float("-inf")       # the last refusal
        self.long_refused_at = float("-inf")  # the last of one that could wait the long bound (its retry is due)
        self.found_full = _Recent(window_s)    # newcomers that could not be admitted at once
        self.freed = _Recent(window_s)         # slots freed by streams that ended
        self.arrived = _Recent(max(window_s, BURST_WINDOW_S))  # newcomers
        self.burst_at = float("-inf")           # the last arrival that made a burst
        self.ttft_errors: deque[float] = deque(maxlen=TTFT_ERRORS)   # first tokens' measured / estimated times
        self.unloaded_ttft: deque[float] = deque(maxlen=TTFT_ERRORS)  # first tokens of requests admitted idle
        self.ttft_target_s = ttft_target_s   # what first tokens are planned to (_note_unloaded)


class _Recent:
    """The times of the events of the last window_s seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._times: deque[float] = deque()

    def add(self, now: float) -> None:
        self._times.append(now)
        self.count(now)

    def count(self, now: float, within_s: float | None = None) -> int:
        """The events of the last window_s seconds, or of the last within_s (at most window_s)."""
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()
        if within_s is None:
            return len(self._times)
        return sum(1 for t in self._times if t > now - within_s)


class OverloadGuard:
    def __init__(self, cfg: OverloadConfig, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic):
        self._cfg = cfg
        self.clock = clock            # monotonic seconds; tests pass a virtual clock
        self._metrics = metrics
        self.metrics = AdmissionMetrics(metrics.registry)
        self._gates: dict[str, _ModelGate] = {}
        self._workers: Mapping[str, int] = {}
        self._default_workers = 0     # for a model the pool view does not list
        self._replicas = 1            # gateway replicas sharing the workers

    # -- the limit ---------------------------------------------------------------------------

    def limit(self, model: str) -> int:
        cfg = self._cfg
        gate = self._gates.get(model)
        capacity = (gate.pool.capacity(cfg.stream_tokens_per_s, steady=gate.standing)
                    if gate and cfg.follow_pool_load else None)
        if capacity is None:
            if cfg.max_in_flight_per_worker <= 0:
                return cfg.max_in_flight_per_model
            capacity = cfg.max_in_flight_per_worker * self._workers.get(model, self._default_workers)
        share = -(-capacity // self._replicas)
        return min(max(share, cfg.min_in_flight_per_model), cfg.max_in_flight_per_model)

    def set_workers(self, workers: Mapping[str, int], default: int = 0, replicas: int = 1) -> None:
        """The routable workers of each model (`default` for the others) and the gateway replicas
        sharing them; limits follow at once."""
        self._workers, self._default_workers, self._replicas = dict(workers), default, max(1, replicas)
        for model in set(self._gates) | set(workers):
            self._gate(model)
        self._refresh()

    def set_pool(self, reports: Mapping[str, Sequence[worker_pb2.LoadReport]], replicas: int = 1) -> None:
        """Each model's routable workers' last load reports, and the replicas sharing them."""
        for model, found in reports.items():
            gate = self._gate(model)
            gate.pool.update(found, self.clock())
            gate.since_report.clear()
        self.set_workers({m: len(r) for m, r in reports.items()}, replicas=replicas)

    def _refresh(self) -> None:
        for model, gate in self._gates.items():
            gate.limit = self.limit(model)
            self._metrics.overload_limit.labels(model=model).set(gate.limit)
            self._wake(model, gate)

    def _gate(self, model: str) -> _ModelGate:
        gate = self._gates.get(model)
        if gate is None:
            gate = self._gates[model] = _ModelGate(0, self._cfg.sustained_window_s, self._cfg.ttft_target_s)
            self.metrics.ttft_target.labels(model=model).set(gate.ttft_target_s)
            gate.limit = self.limit(model)
            self._metrics.overload_limit.labels(model=model).set(gate.limit)
        return gate

    # -- decisions ---------------------------------------------------------------------------

    @staticmethod
    def _spare(gate: _ModelGate) -> int:
        """The slots past the limit that an organization with nothing in flight may take: a quarter
        of it, at least one."""
        return max(1, gate.limit // 4)

    def _fits(self, gate: _ModelGate, org: str, prompt_tokens: int) -> bool:
        if gate.org_in_flight[org] == 0 and fits(gate.in_flight, gate.releases.spare_in_use, gate.limit,
                                                 self._spare(gate), 0):
            return True
        if gate.in_flight >= gate.limit:
            return False
        if gate.in_flight == 0 or not self._cfg.follow_pool_load or self._absorbing(gate):
            return True
        estimate = self._estimate(gate, prompt_tokens, gate.in_flight, self._unreported(gate))
        return estimate is None or self._past_target_s(gate, estimate, self._ttft_margin(gate)) <= 0

    @staticmethod
    def _past_target_s(gate: _ModelGate, estimate: Estimate, margin: float) -> float:
        """How far past the target a first token is planned: its estimate scaled by the margin
        (_ttft_margin, taken once by a caller that plans many: it sorts the recent errors). A prompt
        whose own prefill takes half the target or more counts only half: it would never fit beside
        a queue otherwise, and it keeps the head of the fair order, so the queue drains."""
        target = gate.ttft_target_s
        planned = estimate.queue_s + min(estimate.ttft_s - estimate.queue_s, target / 2)
        return margin * planned - target

    @staticmethod
    def _ttft_margin(gate: _ModelGate) -> float:
        """What a first-token estimate is scaled by before it is held to the target: the 90th
        percentile of the last first tokens' measured / estimated times, at least 1 (1 until
        MIN_TTFT_ERRORS were measured). Estimates right on the mean put a tenth of first tokens
        1.25-2x past them: bench-load's open loop at 1x and 4x capacity got TTFT p95 of 1.08-1.13 s
        and 1.16-1.29 s against the 1 s target; with the margin, 0.96-1.04 s and 1.10-1.11 s, the
        same goodput."""
        if len(gate.ttft_errors) < MIN_TTFT_ERRORS:
            return 1.0
        return max(1.0, statistics.quantiles(gate.ttft_errors, n=10)[-1])

    @staticmethod
    def _estimate(gate: _ModelGate, prompt_tokens: int, others: int, unreported: int) -> Estimate | None:
        """A request's first token and speed beside `others` streams in flight here (the report
        also sees other replicas') and `unreported` prompt tokens queued past the report's."""
        return gate.pool.estimate(prompt_tokens, max(gate.pool.state.running, others), unreported)

    @staticmethod
    def _unreported(gate: _ModelGate, own: int = 0) -> int:
        """The prompt tokens admitted here that the pool's last report may not count: those admitted
        since it, until their first token, or, where more, those still awaiting their first token
        past the prompt tokens it reports queued, as requests on their way to a worker when it was
        taken are in neither.
        bench-load's open loop at 4x capacity from an idle pool: reports showed 1-2 streams running
        while this gateway had admitted 7-13, and first tokens came 2-5.6 s after admission against
        estimates of 1.5-2.3 s. `own`: a request's own prompt, granted already."""
        awaiting = gate.releases.awaiting_prompt_tokens - gate.pool.state.waiting_prompt_tokens
        since = sum(slot.prompt_tokens for slot in gate.since_report if slot.first_token_at is None)
        return max(0, since - own, awaiting - own)

    def estimated_wait_s(self, model: str, ahead: int, org: str = "", prompt_tokens: int = 0) -> float | None:
        """When a request of `org` behind the first `ahead` waiters of the fair order (at most all of
        them) would be admitted."""
        gate = self._gate(model)
        order = self._live_order(gate)
        return self._waits(gate, _turn(order[:ahead]) + [(org, 0, prompt_tokens)])[-1]

    @staticmethod
    def _live_order(gate: _ModelGate) -> list[Waiter]:
        """The waiters in the order _wake would admit them (a cancelled one is skipped there)."""
        return [w for w in gate.queue.ordered() if not w.future.done()]

    def _waits(self, gate: _ModelGate, turn: list[tuple[str, int, int]]) -> list[float | None]:
        """How long each request of `turn` ((organization, answer budget, prompt tokens), in the fair
        order) would wait: until the slot release that lets it fit, replayed on the in-flight
        streams' expected ends (admission/slot_release.py), and until the prompts ahead of it drained
        far enough for _fits (_prompt_waits), whichever is later. None while a hold it needs is
        unknown (before a stream of the model ended or was estimated here)."""
        mean_hold = gate.hold_s or gate.expected_hold_s or None
        granted = gate.releases.admissions(self.clock(), [(org, answer) for org, answer, _ in turn],
                                           gate.limit, self._spare(gate), mean_hold)
        if granted is None:
            return [None] * len(turn)
        if not self._cfg.follow_pool_load:
            return list(granted)
        return [max(at, wait) for at, wait in zip(granted, self._prompt_waits(gate, turn))]

    def _prompt_waits(self, gate: _ModelGate, turn: list[tuple[str, int, int]]) -> list[float]:
        """How long each waiter of `turn` waits for the prompts ahead of it (queued in the pool,
        admitted here since its report, and the waiters' before it in the order) to drain until its
        first token is planned within the target, as _fits plans it: the queue drains a second of
        its estimate a second. 0 where _fits lets the prompts pass: a burst's queue being absorbed,
        an organization with nothing in flight. Counting the queued prompts once for all, at the
        pure prefill rate, said a waiter of a standing queue would make its short bound (0.2-0.4 s)
        and it was refused when that ran out: bench-load's open loop at 2x and 4x capacity refused 0
        of 138 and 108 of 356 within 100 ms, TTFT p95 1.23 and 1.40 s; with this, 116 of 133 and
        332 of 346 (p50 2 ms), TTFT p95 1.02 and 0.93 s, goodput 9% and 25% up (same arrivals)."""
        if self._absorbing(gate):
            return [0.0] * len(turn)
        queued, waits, margin = self._unreported(gate), [], self._ttft_margin(gate)
        for org, _, prompt_tokens in turn:
            estimate = self._estimate(gate, prompt_tokens, gate.in_flight, queued)
            held = estimate is not None and gate.org_in_flight[org] > 0
            waits.append(max(0.0, self._past_target_s(gate, estimate, margin)) if held else 0.0)
            queued += prompt_tokens
        return waits

    def _grant(self, gate: _ModelGate, org: str, cost: float, weight: float, prompt_tokens: int,
               answer_tokens: int) -> Slot:
        spare = gate.in_flight >= gate.limit
        gate.in_flight += 1
        gate.grants += 1
        gate.org_in_flight[org] += 1
        gate.queue.charge(org, cost, weight)
        slot = gate.releases.take(org, self.clock(), answer_tokens, spare, prompt_tokens)
        gate.since_report.append(slot)
        return slot

    def wait_bound_s(self, model: str, org: str = "") -> float:
        """How long a request of `org` arriving now may wait: queue_timeout_s, or the short bound in a
        standing queue if `org` holds slots already and the fair order does not need a waiter of it.
        One with nothing in flight is not the overload: it waits its turn, first in the fair order.
        Beside other organizations, one with nobody queued, or the one the order serves next, keeps
        the long bound, so that each has a request queued when a slot frees: with every
        organization's newcomers refused alike, slots went to whoever came back first after
        Retry-After and weights 2:1 gave 1.25:1; with only the next one's queued, the others' clients
        slept out long Retry-Afters and equal weights gave 0.79:1."""
        cfg, gate = self._cfg, self._gate(model)
        standing = self._standing(model, gate)     # first: it may turn standing or end now
        if not self._held_short(gate, org) or not standing and self._young(gate):
            return cfg.queue_timeout_s
        if self._clump(gate):
            return min(cfg.queue_timeout_s, gate.ttft_target_s)
        if not standing and self._after_burst(gate):
            gate.standing = standing = True         # new load; a burst's waiters keep their bounds
            if not self._burst_queue(gate):
                self._shorten_waits(model, gate)    # those it took while young
        return self._short_bound_s(gate) if standing else cfg.queue_timeout_s

    def _young(self, gate: _ModelGate) -> bool:
        """A queue formed under BURST_WINDOW_S ago, not yet judged a burst's or not: its newcomers
        wait the long bound, and once it is judged new load, the short one from when they joined. An
        accurate wait estimate (_prompt_waits) refused 19 of a warm pool's second burst of 32 at once
        otherwise: those that came before the burst was seen stood under the short bound."""
        since = gate.contended_since
        return since is not None and self.clock() - since < BURST_WINDOW_S

    @staticmethod
    def _burst_queue(gate: _ModelGate) -> bool:
        """A queue stands now, and a burst arrived since shortly before it formed."""
        since = gate.contended_since
        return since is not None and gate.burst_at >= since - BURST_WINDOW_S

    def _absorbing(self, gate: _ModelGate) -> bool:
        """The queue is a burst's and not standing: its waiters are past the first-token target
        already, so only the slots hold them back. Held for the pool's queued prompts too, they
        reached the worker a report at a time and its steps ran short of prompts."""
        return not gate.standing and self._burst_queue(gate)

    def _after_burst(self, gate: _ModelGate) -> bool:
        """A newcomer that waits is new load, not part of a burst the queue may be absorbing, when no
        burst arrived since shortly before the queue formed (Poisson arrivals that filled the pool,
        or its prompt queue, over time), or the queue formed over burst_arrival_s ago and has
        refused nobody who could wait the long bound since (so the newcomer retries no refusal of a
        burst either). bench-load's open loop at 2x capacity: until the queue was seen standing, 7.5
        s on, the waiters that came meanwhile got first tokens 2-5 s after arriving; with the second
        rule alone, the waiters of each queue's first burst_arrival_s, held back by the pool's queued
        prompts and counted as a burst's, got them 2.5-5.6 s after arriving at 4x capacity (admitted
        0.3-3.6 s after arriving, with first tokens 0.5-1.1 s later). A burst's waiters keep their
        bounds: a late newcomer is no reason to turn them away."""
        since = gate.contended_since
        if since is None:
            return False
        return not self._burst_queue(gate) or (
            self.clock() - since > self._cfg.burst_arrival_s and gate.long_refused_at < since)

    def _clump(self, gate: _ModelGate) -> bool:
        """A queue no burst formed, with slots free (only prompts on their way to a first token hold
        its newcomers back) and arrivals (all of them) not outpacing the slots freed: Poisson
        arrivals that clumped below the pool's capacity, not overload. Its newcomers wait up to the
        first-token target for the prompts ahead, and it does not stand; nor does a standing queue
        hold them to the short bound, as one lasts sustained_window_s past its last refusal. Given
        the short bound (the target less the measured 0.6-0.8 s from admission to first token),
        bench-load's open loop at half its capacity refused 1-9 of 52 across runs, each behind
        300-700 prompt tokens of this gateway's in prefill, and 5 of 53 in the 30 s after the
        capacity loop's overload."""
        return (gate.contended_since is not None and gate.in_flight < gate.limit
                and not self._burst_queue(gate) and not self._outpaced(gate, self.clock(), gate.arrived))

    def _short_bound_s(self, gate: _ModelGate) -> float:
        """A standing queue's bound: what the TTFT target leaves past the measured time from admission
        to first token and, while every slot is taken, at most the mean time between slots freed
        (hold / limit). Waiting the whole target, bench-load's open loop at 4x the pool's capacity
        got first tokens 2.2 s after arrival at the median against a 2 s target: a newcomer then
        waits for the step in progress and prefills in one as long. A standing queue keeps a waiter
        ready for the next slot, not a line: with the target's remainder alone, 4x got TTFT p95
        1.94 s (unloaded 0.69 s), with this cap 0.87 s, the same goodput, and more refusals in a few
        ms. With slots free the pool's queued prompts hold the waiters back, and they go as first
        tokens come: capped there too, its open loop at 1x refused 10 of 110 with 16-50 of 64 slots
        in flight (ttft_target_s 0.8 s)."""
        cfg = self._cfg
        bound = max(0.0, min(cfg.queue_timeout_s, gate.ttft_target_s - gate.first_token_s))
        slots_bind = gate.in_flight >= gate.limit and gate.hold_s and gate.limit
        return min(bound, gate.hold_s / gate.limit) if slots_bind else bound

    @staticmethod
    def _held_short(gate: _ModelGate, org: str) -> bool:
        """In a standing queue, `org` waits only the short bound (see wait_bound_s)."""
        return gate.org_in_flight[org] > 0 and not gate.queue.needs_waiter(org)

    def _shorten_waits(self, model: str, gate: _ModelGate) -> None:
        """A queue that turns standing holds the waiters it took under the long bound to the short one
        too, counted from when each joined; _expire refuses those already past it. Left to the long
        bound, they would go ahead of every later arrival, each first token late by as long as the
        queue took to be seen standing (7.5-30 s at make run's settings)."""
        short = self._short_bound_s(gate)
        for waiter in self._live_order(gate):
            if self._held_short(gate, waiter.org):
                waiter.deadline = min(waiter.deadline, waiter.queued_at + short)
        self._expire(model, gate)

    def _standing(self, model: str, gate: _ModelGate) -> bool:
        """A queue stands once every newcomer has had to wait for queue_timeout_s on end, or, after
        contention of 1.5 sustained windows, while in the last window newcomers found the pool full
        OUTPACE times as often as slots were freed: more keep coming than leave (a burst's own
        arrivals, a moment at its onset, have left the window by then, and its clients' retries
        after Retry-After come about as slots free). bench-load's open loop at 4x capacity waited
        out the 30 s of the first rule with every admission's first token late. It stands until
        nobody has been refused for sustained_window_s (under the short bound the queue empties
        between arrivals, so its emptiness does not say the overload is over). Not queue_timeout_s:
        its own refusals renewed it, and bench-load's open loop at half capacity, started right
        after the capacity loop's overload, had a queue standing all its 60 s that refused 6 of 46
        (a refusal each 2-9 s), where a fresh pool refused none."""
        cfg, now = self._cfg, self.clock()
        contended = None if gate.contended_since is None else now - gate.contended_since
        if contended is not None and (contended >= cfg.queue_timeout_s or (
                contended >= 1.5 * cfg.sustained_window_s and self._outpaced(gate, now))):
            if not gate.standing:
                gate.standing = True
                self._shorten_waits(model, gate)
        elif gate.standing and now - gate.refused_at >= cfg.sustained_window_s:
            gate.standing = False
        return gate.standing

    @staticmethod
    def _outpaced(gate: _ModelGate, now: float, newcomers: _Recent | None = None) -> bool:
        """In the last window, newcomers (by default those that found the pool full) came OUTPACE
        times as often as slots freed, and at least OUTPACE_MIN of them."""
        came = (gate.found_full if newcomers is None else newcomers).count(now)
        return came >= OUTPACE_MIN and came >= OUTPACE * gate.freed.count(now)

    def _wake(self, model: str, gate: _ModelGate) -> None:
        while len(gate.queue):
            waiter = gate.queue.peek()
            if not waiter.future.done() and not self._fits(gate, waiter.org, waiter.prompt_tokens):
                break
            gate.queue.pop()
            if waiter.future.done():
                continue
            waiter.future.set_result(self._grant(gate, waiter.org, waiter.cost, waiter.weight, waiter.prompt_tokens,
                                                 waiter.answer_tokens))
        if not len(gate.queue) and gate.in_flight < gate.limit:
            gate.contended_since = None
        self._expire(model, gate)

    def _expire(self, model: str, gate: _ModelGate) -> None:
        """Refuses, now, each waiter past its deadline or whose renewed estimate puts its admission
        past it; the first such in the fair order first, as those behind it move up once it leaves."""
        now = self.clock()
        while True:
            order = self._live_order(gate)
            waits = self._waits(gate, _turn(order))
            late = next(((w, e) for w, e in zip(order, waits) if now + (e or 0.0) > w.deadline), None)
            if late is None:
                return
            waiter, estimate = late
            gate.queue.discard(waiter)
            why = "queue timeout" if estimate is None else f"estimated wait {estimate:.1f}s"
            waiter.future.set_exception(self._refusal(model, waiter.org, why, estimate))

    def _refusal(self, model: str, org: str, why: str, wait_s: float | None) -> Overloaded:
        """Refuses a request whose admission is estimated wait_s away (None: unknown) with a Retry-After
        for when it would wait half its bound on return: coming back at wait_s, a burst's refused
        requests slept past the slots freed for them and the pool ran short (bench-load's burst
        waited 12.5 s where 14.6 s was estimated); half the bound is the margin for the estimate's
        error, as a second refusal spends one of the client's retries."""
        cfg, gate = self._cfg, self._gate(model)
        gate.refused_at = self.clock()
        bound = self.wait_bound_s(model, org)
        if bound >= cfg.queue_timeout_s:
            gate.long_refused_at = gate.refused_at
        self._metrics.overload_refusals.labels(model=model).inc()
        self.metrics.decisions.labels(model=model, organization=org, decision="refused").inc()
        retry_s = cfg.retry_after_s if wait_s is None else max(cfg.retry_after_s, wait_s - bound / 2)
        retry_s = min(MAX_RETRY_AFTER_S, retry_s)
        return Overloaded(cfg.refuse_status, f"the model `{model}` is overloaded ({why}); retry shortly",
                          code="overloaded", type="rate_limit_error" if cfg.refuse_status == 429 else None,
                          headers={"Retry-After": str(max(1, math.ceil(retry_s))),
                                   "retry-after-ms": str(int(retry_s * 1000))})

    def _arrival(self, gate: _ModelGate, now: float) -> None:
        """Counts a newcomer; one that makes a burst (overload.burst_share of the limit, at least
        BURST_MIN, within BURST_WINDOW_S; a share of 0: every newcomer) marks it. A queue that formed
        moments ago and was taken for new load stands no more: the burst came after its first waiters."""
        cfg = self._cfg
        gate.arrived.add(now)
        arrived = gate.arrived.count(now, BURST_WINDOW_S)
        if cfg.burst_share and arrived < max(BURST_MIN, cfg.burst_share * gate.limit):
            return
        since = gate.contended_since
        if since is not None and now - since < cfg.burst_arrival_s and not self._burst_queue(gate):
            gate.standing = False
        gate.burst_at = now

    @asynccontextmanager
    async def admit(self, model: str, org: str = "", weight: float = 1.0, priority: int = 0,
                    prompt_tokens: int = 0, max_tokens: int | None = None) -> AsyncIterator[Ticket]:
        """Holds one of the model's slots while the body runs. Raises Overloaded (nothing held)."""
        cfg = self._cfg
        gate = self._gate(model)
        answer_tokens = max_tokens or cfg.default_output_tokens
        cost = token_cost(prompt_tokens, answer_tokens)
        now = self.clock()
        self._arrival(gate, now)
        gate.queue.join(org)
        idle = self._idle(gate)
        try:
            if (not len(gate.queue) or not gate.org_in_flight[org]) and self._fits(gate, org, prompt_tokens):
                if gate.in_flight < gate.limit:
                    gate.contended_since = None     # a free slot: no standing queue
                slot = self._grant(gate, org, cost, weight, prompt_tokens, answer_tokens)
                self.metrics.decisions.labels(model=model, organization=org, decision="admitted").inc()
            else:
                if gate.contended_since is None:
                    gate.contended_since = now
                gate.found_full.add(now)
                slot = await self._queue(model, gate, Waiter(org, weight, priority, cost, prompt_tokens=prompt_tokens,
                                                             answer_tokens=answer_tokens))
        except BaseException:
            gate.queue.leave(org)
            raise
        ticket = Ticket(model, org, prompt_tokens, admitted_at=self.clock(), idle=idle,
                        grants_at=gate.grants, _guard=self, _slot=slot)
        ticket.estimate = self._estimate(gate, prompt_tokens, gate.in_flight - 1, self._unreported(gate, prompt_tokens))
        if ticket.estimate is not None:
            hold = ticket.estimate.ttft_s + answer_tokens / ticket.estimate.tokens_per_s
            slot.predicted_hold_s = hold
            gate.expected_hold_s = _mean(gate.expected_hold_s, hold)
            self.metrics.ttft_estimate.labels(model=model).observe(ticket.estimate.ttft_s)
            self.metrics.stream_speed_estimate.labels(model=model).set(ticket.estimate.tokens_per_s)
        in_flight = self._metrics.in_flight.labels(model=model)
        in_flight.set(gate.in_flight)
        try:
            yield ticket
        finally:
            held = self.clock() - ticket.admitted_at
            gate.hold_s = _mean(gate.hold_s, held)
            gate.releases.free(slot, self.clock())
            gate.freed.add(self.clock())
            gate.in_flight -= 1
            self._forget(gate, org)
            gate.queue.leave(org)
            in_flight.set(gate.in_flight)
            self._wake(model, gate)

    def _idle(self, gate: _ModelGate) -> bool:
        """Nothing in flight here and, where other replicas share the pool, nothing running or
        waiting in its last report: their streams are in no count of this replica's, and a first
        token beside them is no unloaded one. Alone, this replica's own count is the fresher (the
        report lags a poll, and shows the stream that has just ended)."""
        if gate.in_flight:
            return False
        state = gate.pool.state
        return self._replicas == 1 or not (state.running or state.waiting)

    def _note_unloaded(self, model: str, gate: _ModelGate, ttft_s: float) -> None:
        """The first token of a request admitted to an idle pool, with nobody admitted beside it
        before that token, and the target that follows from the recent ones
        (overload.ttft_target_over_unloaded). Measured, not estimated: under load a 2-core worker's
        reported prefill rate fell by half and more, and a target from estimates rose with it, to
        6 s, where the same pool's idle first tokens took 0.5-2 s. Under sustained load no sample
        comes, and the target stays what the idle pool showed. The first of a burst was admitted
        to an idle pool too, but prefilled beside the rest: counted, bench-load's target was 0.59-
        0.63 s, 2.2-2.4x the unloaded p95 its clients measured (0.27 s), not 1.7x."""
        ratio = self._cfg.ttft_target_over_unloaded
        if not ratio:
            return
        gate.unloaded_ttft.append(ttft_s)
        if len(gate.unloaded_ttft) >= MIN_TTFT_ERRORS:
            gate.ttft_target_s = ratio * statistics.quantiles(gate.unloaded_ttft, n=20)[-1]
            self.metrics.ttft_target.labels(model=model).set(gate.ttft_target_s)

    async def _queue(self, model: str, gate: _ModelGate, waiter: Waiter) -> Slot:
        """The slot granted to `waiter` once its turn came; raises Overloaded (nothing held)."""
        cfg = self._cfg
        if len(gate.queue) >= cfg.max_queued_per_model:
            raise self._refusal(model, waiter.org, "queue full", self._wait_behind_all(model, gate, waiter))
        bound = self.wait_bound_s(model, waiter.org)
        started = waiter.queued_at = self.clock()
        waiter.deadline = started + bound
        gate.queue.push(waiter)
        order = self._live_order(gate)
        estimate = self._waits(gate, _turn(order[:order.index(waiter) + 1]))[-1]
        if estimate is not None and estimate > bound:
            gate.queue.discard(waiter)
            raise self._refusal(model, waiter.org, f"estimated wait {estimate:.1f}s", estimate)
        self._expire(model, gate)          # the fair order may have put it ahead of others
        self.metrics.decisions.labels(model=model, organization=waiter.org, decision="queued").inc()
        queued = self._metrics.queued.labels(model=model)
        queued.inc()
        try:
            # Not wait_for: on 3.11 it returns a result that came with the cancellation and drops the
            # cancellation, which left a disconnected client's task holding the slot it was granted.
            if not (await asyncio.wait((waiter.future,), timeout=bound))[0]:
                raise TimeoutError
        except BaseException as e:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self._release_granted(model, gate, waiter.org, future.result())   # granted as we gave up: hand it on
            elif not future.done():
                future.cancel()
            gate.queue.discard(waiter)
            if isinstance(e, TimeoutError):
                raise self._refusal(model, waiter.org, "queue timeout",
                                    self._wait_behind_all(model, gate, waiter)) from None
            raise
        finally:
            queued.dec()
        self.metrics.queue_wait.labels(model=model).observe(self.clock() - started)
        if estimate is not None:
            self.metrics.queue_wait_estimate.labels(model=model).observe(estimate)
        return waiter.future.result()

    def _wait_behind_all(self, model: str, gate: _ModelGate, waiter: Waiter) -> float | None:
        """A refused waiter's wait were it to come back now, behind everyone queued."""
        return self.estimated_wait_s(model, len(gate.queue), waiter.org, waiter.prompt_tokens)

    def _release_granted(self, model: str, gate: _ModelGate, org: str, slot: Slot) -> None:
        gate.releases.free(slot, self.clock(), measured=False)
        gate.in_flight -= 1
        self._forget(gate, org)
        self._wake(model, gate)

    @staticmethod
    def _forget(gate: _ModelGate, org: str) -> None:
        gate.org_in_flight[org] -= 1
        if gate.org_in_flight[org] <= 0:
            del gate.org_in_flight[org]

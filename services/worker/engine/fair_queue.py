"""The waiting queue: tenants in weighted fair order by tokens served, priority within a tenant.

Each tenant (organization) has a virtual token counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024): every token the scheduler grants one of its requests adds
(input_weight per prompt token, output_weight per generated token) / tenant weight. The next
request admitted belongs to the backlogged tenant with the smallest counter; within a tenant the
lowest priority value goes first (vLLM's convention), then arrival order. A tenant that becomes
active is lifted to the smallest counter of the tenants already active, so idle time is not banked;
a tenant with nothing waiting or running is forgotten.

Preempted requests come back ahead of everyone (their tenant was already charged), as the head of
a first-come-first-served queue would. One tenant ("" by default) gives plain FCFS order.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    from services.worker.engine.request import Request
    from services.worker.engine.scheduler import ScheduledRequest

INPUT_WEIGHT = 1.0      # the paper's w_p: prompt tokens are cheaper than generated ones
OUTPUT_WEIGHT = 2.0     # w_q
MAX_WEIGHT = 1000.0


@dataclass(frozen=True)
class FairShare:
    """Who a request is charged to and how it ranks within its tenant."""
    tenant: str = ""
    weight: float = 1.0
    priority: int = 0   # lower first

    @classmethod
    def of(cls, tenant: str, weight: float, priority: int) -> "FairShare":
        """From the wire: weight 0 means 1. Raises ValueError for a weight out of (0, MAX_WEIGHT]."""
        if weight == 0:
            weight = 1.0
        if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
            raise ValueError(f"tenant_weight must be in (0, {MAX_WEIGHT:g}], got {weight}")
        return cls(tenant, float(weight), int(priority))


@dataclass
class _Tenant:
    counter: float = 0.0
    active: int = 0                                   # its requests waiting or running
    heap: list = field(default_factory=list)          # (priority, arrival, request)


class FairQueue:
    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self._preempted: deque[Request] = deque()
        self._arrivals = itertools.count()
        self._size = 0

    # -- membership ----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """A new request: its tenant becomes (or stays) active."""
        name = request.share.tenant
        tenant = self._tenants.get(name)
        if tenant is None:
            active = [t.counter for t in self._tenants.values()]
            tenant = self._tenants[name] = _Tenant(counter=min(active, default=0.0))
        tenant.active += 1
        self._push(tenant, request)

    def requeue(self, request: Request) -> None:
        """A preempted request: back at the head."""
        self._preempted.appendleft(request)
        self._size += 1

    def peek(self) -> Request:
        if self._preempted:
            return self._preempted[0]
        return self._next_tenant().heap[0][2]

    def pop(self) -> Request:
        """Takes what peek() returned."""
        self._size -= 1
        if self._preempted:
            return self._preempted.popleft()
        return heapq.heappop(self._next_tenant().heap)[2]

    def _next_tenant(self) -> _Tenant:
        """The backlogged tenant with the smallest counter; on a tie one with nothing running (a
        tenant turning active takes the smallest counter, so a light user's newcomer ties with a
        flood's and would wait behind its queue), then the earliest arrival."""
        return min((t for t in self._tenants.values() if t.heap),
                   key=lambda t: (t.counter, t.active > len(t.heap), t.heap[0][1]))

    def remove(self, request: Request) -> None:
        """Takes a waiting request out (aborted); finished() still has to be called."""
        if request in self._preempted:
            self._preempted.remove(request)
        else:
            tenant = self._tenants[request.share.tenant]
            tenant.heap = [e for e in tenant.heap if e[2] is not request]
            heapq.heapify(tenant.heap)
        self._size -= 1

    def finished(self, request: Request) -> None:
        """The request left the engine (finished or aborted): an idle tenant is forgotten."""
        tenant = self._tenants.get(request.share.tenant)
        if tenant is not None:
            tenant.active -= 1
            if tenant.active <= 0:
                del self._tenants[request.share.tenant]

    # -- charging ------------------------------------------------------------------------------

    def charge(self, scheduled: Iterable[ScheduledRequest]) -> None:
        """Adds the tokens granted this step to their tenants' counters (summed per tenant first:
        this runs over every scheduled request, every step)."""
        totals: dict[str, float] = {}
        get = totals.get
        for item in scheduled:
            r = item.request
            share, n = r.share, item.num_new_tokens
            prompt_left = len(r.prompt_token_ids) - item.start_position
            if prompt_left <= 0:   # decoding
                cost = OUTPUT_WEIGHT * n
            else:
                prompt = n if n < prompt_left else prompt_left
                cost = INPUT_WEIGHT * prompt + OUTPUT_WEIGHT * (n - prompt)
            totals[share.tenant] = get(share.tenant, 0.0) + cost / share.weight
        for name, cost in totals.items():
            tenant = self._tenants.get(name)
            if tenant is not None:
                tenant.counter += cost

    def active_counts(self) -> list[int]:
        """Requests waiting or running, per tenant that has any."""
        return [t.active for t in self._tenants.values()]

    def head_tenant_idle(self) -> bool:
        """peek()'s tenant has nothing running (every request of it waits; a preempted head ran)."""
        if self._preempted or not self._size:
            return False
        tenant = self._tenants[self.peek().share.tenant]
        return tenant.active == len(tenant.heap)

    def counter(self, tenant: str) -> float | None:
        t = self._tenants.get(tenant)
        return t.counter if t else None

    def head_rank(self) -> float:
        """Where peek()'s request stands against other tenants: its tenant's counter, or -inf for a
        preempted one (ahead of everyone)."""
        return -math.inf if self._preempted else self._tenants[self.peek().share.tenant].counter

    # -- views ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self)

    def __iter__(self) -> Iterator[Request]:
        """Preempted first, then by (priority, arrival); the order across tenants at scheduling
        time also depends on their counters."""
        yield from self._preempted
        yield from (e[2] for e in sorted(e for t in self._tenants.values() for e in t.heap))

    def __getitem__(self, index: int) -> Request:
        return list(self)[index]

    def _push(self, tenant: _Tenant, request: Request) -> None:
        heapq.heappush(tenant.heap, (request.share.priority, next(self._arrivals), request))
        self._size += 1

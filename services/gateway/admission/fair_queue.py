"""The gateway's waiting room for one model: priority bands, then organizations in weighted fair
order by tokens, then arrival.

Priority classes go strictly first (interactive before batch, as llm-d's flow control bands).
Inside a band every organization has a virtual token counter (Sheng et al., OSDI 2024): each
admitted request adds its tokens (prompt + OUTPUT_WEIGHT x expected answer) / the organization's
weight, and the next admitted request is the oldest of the organization with the smallest counter.
An organization that becomes active is lifted to the smallest counter of those active, so idle
time is not banked; one with nothing queued or in flight is forgotten. On equal counters the
organization holding fewer slots goes first: a light one coming back is lifted to exactly a
flood's counter, and by arrival alone it waited behind the flood's oldest waiter for the next slot.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from dataclasses import dataclass, field

OUTPUT_WEIGHT = 2.0


@dataclass(eq=False)
class Waiter:
    org: str
    weight: float
    priority: int                  # lower first
    cost: float                    # tokens it will be charged when admitted
    prompt_tokens: int = 0
    answer_tokens: int = 0         # its answer budget (max_tokens, or the default)
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    arrival: int = 0
    queued_at: float = 0.0         # time.monotonic() when it joined the queue
    deadline: float = 0.0          # time.monotonic() past which it is refused rather than admitted


def token_cost(prompt_tokens: int, answer_tokens: int) -> float:
    return prompt_tokens + OUTPUT_WEIGHT * answer_tokens


@dataclass
class _Org:
    counter: float = 0.0
    active: int = 0                # queued or in flight
    queue: list = field(default_factory=list)   # its waiters by (priority, arrival)


class FairQueue:
    def __init__(self) -> None:
        self._orgs: dict[str, _Org] = {}
        self._arrivals = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def join(self, org: str) -> None:
        """A request of `org` arrives (queued or admitted at once): the organization is active."""
        entry = self._orgs.get(org)
        if entry is None:
            entry = self._orgs[org] = _Org(counter=min((o.counter for o in self._orgs.values()), default=0.0))
        entry.active += 1

    def leave(self, org: str) -> None:
        """A request of `org` left (refused, cancelled or done)."""
        entry = self._orgs.get(org)
        if entry is not None:
            entry.active -= 1
            if entry.active <= 0 and not entry.queue:
                del self._orgs[org]

    def charge(self, org: str, cost: float, weight: float) -> None:
        entry = self._orgs.get(org)
        if entry is not None:
            entry.counter += cost / weight

    def push(self, waiter: Waiter) -> None:
        waiter.arrival = next(self._arrivals)
        bisect.insort(self._orgs[waiter.org].queue, waiter, key=lambda w: (w.priority, w.arrival))
        self._size += 1

    @staticmethod
    def _held(entry: _Org) -> int:
        """Its requests in flight: active ones not queued."""
        return entry.active - len(entry.queue)

    def peek(self) -> Waiter | None:
        heads = [o.queue[0] for o in self._orgs.values() if o.queue]
        if not heads:
            return None
        return min(heads, key=lambda w: (w.priority, self._orgs[w.org].counter, self._held(self._orgs[w.org]),
                                         w.arrival))

    def pop(self) -> Waiter:
        waiter = self.peek()
        self._orgs[waiter.org].queue.pop(0)
        self._size -= 1
        return waiter

    def discard(self, waiter: Waiter) -> None:
        entry = self._orgs.get(waiter.org)
        if entry is not None and waiter in entry.queue:
            entry.queue.remove(waiter)
            self._size -= 1

    def ordered(self) -> list[Waiter]:
        """The waiters in the order they would be admitted, each charging its organization as it goes."""
        counters = {name: o.counter for name, o in self._orgs.items()}
        held = {name: self._held(o) for name, o in self._orgs.items()}
        heads = {name: 0 for name, o in self._orgs.items() if o.queue}
        order: list[Waiter] = []
        while heads:
            name = min(heads, key=lambda n: (self._orgs[n].queue[heads[n]].priority, counters[n], held[n],
                                             self._orgs[n].queue[heads[n]].arrival))
            head = self._orgs[name].queue[heads[name]]
            order.append(head)
            counters[name] += head.cost / head.weight
            held[name] += 1
            heads[name] += 1
            if heads[name] == len(self._orgs[name].queue):
                del heads[name]
        return order

    def position(self, waiter: Waiter) -> int:
        """How many waiters are admitted before it."""
        return self.ordered().index(waiter)

    def needs_waiter(self, org: str) -> bool:
        """Another organization is active too, and `org` has nothing queued or the smallest counter
        (the fair order serves it next): a waiter of it keeps the order able to choose it when a
        slot frees. The virtual token counters share slots by weight only between organizations
        that have someone waiting."""
        entry = self._orgs.get(org)
        others = [o.counter for name, o in self._orgs.items() if name != org and o.active > 0]
        return entry is not None and bool(others) and (not entry.queue or entry.counter <= min(others))

    def counter(self, org: str) -> float | None:
        entry = self._orgs.get(org)
        return entry.counter if entry else None

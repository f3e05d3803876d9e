"""When a model's in-flight streams free their slots, so that a waiter's wait is read off them.

Each granted slot remembers when it was granted, when its first token came, the tokens it has
streamed and its answer budget (max_tokens, or the default). A hold is a first token, then a
decode: the slot is expected to free at its first token (or, before it, at its grant + the
measured time to a first token) + its budget x the seconds per budgeted token measured after the
first token over this model's streams that ended here (which counts answers that stop before
their budget). Measured apart, a short answer's wait for its first token does not make every
token of a long one look slow. Once a stream has streamed a few tokens, its own pace tells the
rest: what is left of its budget at that pace, scaled by the share of their budgets the ended
streams used. From the means alone, under a load heavier than the one they were measured at,
the streams next to end were all overdue (expected to free "any moment" for up to a second), and
a standing queue's waiters counted on them: of 211 refusals of Poisson arrivals at 8 requests/s
through `make run`, 27 came after a waiter's whole short bound (7 with this). Before any stream
ended: the pool's estimate at admission (first token + budget / per-stream speed), or else the
caller's mean hold. An overdue slot may free any moment (0 s).

A waiter's wait is a replay of how overload.py's _wake hands out slots, on these expected releases:
freed slots go to the waiters in the fair queue's order, the head taking one once it fits
(`fits`), and a slot
granted to a waiter frees again after that waiter's own budget. So with the streams in flight
ending in the order of their remaining times, the waiter whose turn needs n releases is admitted at
the n-th of them. This replaces the fluid n x hold / limit, which spreads the releases evenly: at 2
slots of 94 s it said 47 s for the next slot even when one stream was seconds from its end. The
replay ignores what it cannot know: arrivals ahead of a waiter, limit changes, and the pool's
prompt backlog (overload.py adds that separately).
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

PER_TOKEN_ALPHA = 0.2    # weight of the newest ended stream in the measured means (per token, first token)
PACE_TOKENS = 4          # tokens a stream streams before its own pace tells its remaining time


def fits(in_flight: int, spare_in_use: int, limit: int, spare: int, org_in_flight: int) -> bool:
    """The slot rule, without the pool's prompt backlog: under the limit; or, for an organization
    with nothing in flight, one of `spare` slots past it, while in_flight < limit + spare or fewer
    than `spare` of the streams in flight were granted past the limit. Counted apart, so that
    streams left above a limit that fell (a flood's, admitted under the higher one) do not use up
    the spare slots: a light organization then waited for several of them to end."""
    if in_flight < limit:
        return True
    return org_in_flight == 0 and (in_flight < limit + spare or spare_in_use < spare)


@dataclass(eq=False)
class Slot:
    org: str
    granted_at: float
    budget_tokens: int
    spare: bool = False                      # granted past the limit
    prompt_tokens: int = 0
    predicted_hold_s: float | None = None   # the pool's estimate at admission (None: none made)
    first_token_at: float | None = None     # when its first token went out (None: not yet, or never)
    tokens: int = 0                         # streamed so far
    last_token_at: float = 0.0              # when the last of them went out


class SlotReleases:
    """One model's granted slots on this gateway replica."""

    def __init__(self) -> None:
        self._slots: set[Slot] = set()
        self.spare_in_use = 0      # slots in flight granted past the limit
        self.s_per_token = 0.0     # measured seconds per budgeted token after the first (0: none ended)
        self.s_per_streamed = 0.0  # the same per token streamed (0: none ended with a token)
        self.first_token_s = 0.0   # measured seconds from grant to first token (0: none measured)
        self.awaiting_prompt_tokens = 0   # the prompts of the slots whose first token has not come

    def __len__(self) -> int:
        return len(self._slots)

    def take(self, org: str, now: float, budget_tokens: int, spare: bool, prompt_tokens: int = 0) -> Slot:
        slot = Slot(org, now, max(1, budget_tokens), spare, prompt_tokens)
        self._slots.add(slot)
        self.spare_in_use += spare
        self.awaiting_prompt_tokens += prompt_tokens
        return slot

    def first_token(self, slot: Slot, now: float) -> bool:
        """The slot's first token went out now; False if it had already (or the slot was freed)."""
        if slot.first_token_at is not None or slot not in self._slots:
            return False
        slot.first_token_at = now
        self.awaiting_prompt_tokens -= slot.prompt_tokens
        return True

    def progress(self, slot: Slot, tokens: int, now: float) -> None:
        """The slot's stream has streamed `tokens` by now."""
        slot.tokens, slot.last_token_at = tokens, now

    def free(self, slot: Slot, now: float, measured: bool = True) -> None:
        """The slot's stream ended (measured: its hold teaches the speed; not for a grant handed back unused)."""
        if slot in self._slots:
            self._slots.remove(slot)
            self.spare_in_use -= slot.spare
            if slot.first_token_at is None:
                self.awaiting_prompt_tokens -= slot.prompt_tokens
        if not measured:
            return
        decode_from = slot.granted_at
        if slot.first_token_at is not None:
            decode_from = slot.first_token_at
            self.first_token_s = _mean(self.first_token_s, max(0.0, slot.first_token_at - slot.granted_at))
        self.s_per_token = _mean(self.s_per_token, max(0.0, now - decode_from) / slot.budget_tokens)
        if slot.first_token_at is not None and slot.tokens:   # counted as s_per_token is: a full answer used 1
            self.s_per_streamed = _mean(self.s_per_streamed, max(0.0, now - decode_from) / slot.tokens)

    def hold_s(self, budget_tokens: int, predicted_s: float | None, mean_hold_s: float | None) -> float | None:
        """How long a stream of this budget holds its slot from its grant (None: nothing to tell)."""
        if self.s_per_token:
            return self.first_token_s + self.s_per_token * max(1, budget_tokens)
        return predicted_s if predicted_s is not None else mean_hold_s

    def _remaining_s(self, slot: Slot, now: float, mean_hold_s: float | None) -> float | None:
        """How long until a slot in flight frees (0: overdue); None: nothing to tell."""
        if slot.first_token_at is not None and slot.tokens >= PACE_TOKENS:
            pace = (slot.last_token_at - slot.first_token_at) / (slot.tokens - 1)
            used = min(1.0, self.s_per_token / self.s_per_streamed) if self.s_per_streamed else 1.0
            left = max(0, slot.budget_tokens - slot.tokens) * used * pace
            return max(0.0, slot.last_token_at + left - now)
        if self.s_per_token and slot.first_token_at is not None:
            return max(0.0, slot.first_token_at + self.s_per_token * slot.budget_tokens - now)
        hold = self.hold_s(slot.budget_tokens, slot.predicted_hold_s, mean_hold_s)
        return None if hold is None else max(0.0, slot.granted_at + hold - now)

    def admissions(self, now: float, turn: Sequence[tuple[str, int]], limit: int, spare: int,
                   mean_hold_s: float | None) -> list[float] | None:
        """Seconds from now at which each request of `turn` ((organization, answer budget), in the fair
        order) is granted a slot, replaying _wake on the expected releases (see the module
        docstring); None when a hold it needs is unknown."""
        releases: list[tuple[float, int, str, bool]] = []   # (seconds from now, tie-break, organization, spare)
        held: Counter[str] = Counter()
        for slot in self._slots:
            remaining = self._remaining_s(slot, now, mean_hold_s)
            if remaining is None:
                return None
            releases.append((remaining, len(releases), slot.org, slot.spare))
            held[slot.org] += 1
        heapq.heapify(releases)
        at, granted, spare_in_use = 0.0, [], self.spare_in_use
        for i, (org, budget) in enumerate(turn):
            while not fits(len(releases), spare_in_use, limit, spare, held[org]):
                if not releases:
                    return None
                at, _, gone, was_spare = heapq.heappop(releases)
                held[gone] -= 1
                spare_in_use -= was_spare
            granted.append(at)
            if i + 1 < len(turn):        # its own release matters only to those behind it
                hold = self.hold_s(budget, None, mean_hold_s)
                if hold is None:
                    return None
                past = len(releases) >= limit
                heapq.heappush(releases, (at + hold, len(granted) + len(self._slots), org, past))
                held[org] += 1
                spare_in_use += past
        return granted


def _mean(mean: float, sample: float) -> float:
    """The running mean's next value (the first sample sets it)."""
    return sample if not mean else mean + PER_TOKEN_ALPHA * (sample - mean)

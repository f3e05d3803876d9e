"""Checks a streamed completion against the output rules without ever emitting blocked text.

A match can be split across any number of deltas, so the guard holds back the stream's tail: the
longest text any rule can match, plus LOOKAHEAD_CHARS so that a match ending at the tail (whose
right edge, e.g. a word boundary, is not known yet) is only judged once the next character arrives
or the stream ends. Everything before the tail can no longer start a match and is released.
Rules should not use ^ or $: the guard sees a sliding window, not the whole text.
"""

from __future__ import annotations

import re
from typing import Iterator, Sequence

from .classifier import ModerationResult
from .rules import Rule

LOOKAHEAD_CHARS = 1


class OutputGuard:
    def __init__(self, rules: Sequence[Rule], categories: Sequence[str] = ()) -> None:
        self._rules = [r for r in rules if "output" in r.applies_to]
        self._categories = tuple(categories)
        longest = max((r.max_match_chars for r in self._rules), default=0)
        self._hold = longest + LOOKAHEAD_CHARS if self._rules else 0
        self._context = ""     # the released tail that a match's left edge (lookbehind) may look at
        self._pending = ""     # received, not released
        self._released = 0     # characters released so far: absolute position of _pending[0]
        self._flag_from: dict[str, int] = {}   # per flag rule, where its next new match may start
        self.flagged: list[ModerationResult] = []   # flag-rule matches so far, for metering and logs
        self.blocked: ModerationResult | None = None  # set once a block rule matched; the stream must stop

    def feed(self, delta: str) -> tuple[str, ModerationResult | None]:
        """Returns the text safe to emit now, and the result once a block rule matched; after that
        nothing more is ever released (stop generation, finish_reason content_filter)."""
        if self.blocked:
            return "", self.blocked
        self._pending += delta
        return self._release(final=False)

    def finish(self) -> str:
        """Releases the held-back tail at the end of the stream. A block match there is not released
        and sets `blocked`: check it after finish() to choose finish_reason content_filter."""
        if self.blocked:
            return ""
        text, _ = self._release(final=True)
        return text

    def _release(self, final: bool) -> tuple[str, ModerationResult | None]:
        window = self._context + self._pending
        start = len(self._context)                  # where _pending begins in the window
        offset = self._released - start            # absolute position of window[0]
        judged_until = len(window) if final else len(window) - LOOKAHEAD_CHARS
        block_at: tuple[int, Rule] | None = None
        for rule in self._rules:
            for m in self._new_matches(rule, window, start, judged_until, offset):
                if rule.blocks:
                    if block_at is None or m.start() < block_at[0]:
                        block_at = (m.start(), rule)
                    break
                self.flagged.append(rule.result(self._categories))
                self._flag_from[rule.name] = offset + m.end()
        if block_at is not None:
            position, rule = block_at
            self.blocked = rule.result(self._categories)
            safe = self._pending[:max(0, position - start)]
            self._pending = ""
            return safe, self.blocked
        cut = len(window) if final else max(start, len(window) - self._hold)
        released = window[start:cut]
        self._pending = window[cut:]
        self._released += len(released)
        self._context = (self._context + released)[-self._hold:] if self._hold else ""
        return released, None

    def _new_matches(self, rule: Rule, window: str, start: int, judged_until: int, offset: int) -> Iterator[re.Match]:
        """Matches that reach into the pending text and are judged, leftmost first. Searching from
        every start (not finditer) keeps a stale match in the context from hiding one that overlaps it."""
        at = 0 if rule.blocks else max(0, self._flag_from.get(rule.name, 0) - offset)
        while (m := rule.pattern.search(window, at)) is not None:
            if m.end() > judged_until:
                return                               # its right edge is not known yet: wait for more text
            if m.end() <= start or m.end() == m.start():
                at = m.start() + 1                   # judged while it was pending, or empty
                continue
            yield m
            at = m.end()

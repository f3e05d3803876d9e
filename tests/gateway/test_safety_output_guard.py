"""The streaming output guard: matches split across deltas are caught, blocked text is never
emitted, clean text comes out unchanged, and the hold-back stays bounded."""

from __future__ import annotations

import random

import pytest

from services.gateway.safety.output_guard import LOOKAHEAD_CHARS, OutputGuard
from services.gateway.safety.rules import RuleConfig, compile_rule

RULES = [
    compile_rule(RuleConfig("bad-word", "keyword", ["forbidden fruit", "bad"], "nasty"), 64, "test"),
    compile_rule(RuleConfig("card", "regex", r"\b(?:\d{4}[ -]?){3}\d{4}\b", "pii", action="flag",
                            max_match_chars=19), 64, "test"),
    compile_rule(RuleConfig("input-only", "keyword", "hello", "x", applies_to=["input"]), 64, "test"),
]
HOLD = 19 + LOOKAHEAD_CHARS  # the longest output rule, plus one character to judge a match's right edge


def chunks(text: str, rng: random.Random, largest: int = 5) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.randint(0, largest)  # empty deltas happen too
        out.append(text[i:i + n])
        i += n
    return out


def stream(guard: OutputGuard, deltas: list[str]) -> tuple[str, object]:
    emitted, received = "", ""
    for delta in deltas:
        received += delta
        text, result = guard.feed(delta)
        emitted += text
        if result:
            return emitted, result
        assert len(received) - len(emitted) <= HOLD  # the hold-back is bounded
    return emitted + guard.finish(), guard.blocked


@pytest.mark.parametrize("seed", range(20))
def test_clean_text_comes_out_unchanged(seed):
    rng = random.Random(seed)
    text = "Hello there! A badge, a badger and 1234 5678 are fine; forbidden fruits? no, forbidden-ish. " * 3
    guard = OutputGuard(RULES, ["nasty", "pii"])
    emitted, blocked = stream(guard, chunks(text, rng))
    assert emitted == text and blocked is None and guard.flagged == []


@pytest.mark.parametrize("seed", range(20))
def test_a_match_split_across_tiny_chunks_is_never_emitted(seed):
    rng = random.Random(seed)
    text = "The answer is: Forbidden Fruit, and more text follows after it."
    guard = OutputGuard(RULES, ["nasty", "pii"])
    emitted, result = stream(guard, chunks(text, rng, largest=2))
    assert result is not None and result.blocked and result.matched_rule == "bad-word"
    assert result.categories == {"nasty": True, "pii": False}
    assert emitted == "The answer is: "  # everything before the match, nothing of it
    assert guard.feed("more") == ("", result) and guard.finish() == ""


def test_one_character_at_a_time():
    guard = OutputGuard(RULES)
    emitted, result = stream(guard, list("so bad."))
    assert result.matched_rule == "bad-word" and emitted == "so "


def test_a_match_at_the_very_end_is_caught_by_finish():
    guard = OutputGuard(RULES)
    emitted = "".join(guard.feed(c)[0] for c in "that is BAD")  # 'BAD' could still become 'BADGE'
    assert "B" not in emitted and guard.blocked is None
    assert emitted + guard.finish() == "that is "
    assert guard.blocked is not None and guard.blocked.matched_rule == "bad-word"


def test_word_boundaries_hold_across_chunks():
    guard = OutputGuard(RULES)
    emitted, result = stream(guard, ["ba", "d", "ge ", "a", "bad", "ger"])
    assert emitted == "badge abadger" and result is None


def test_flags_pass_through_and_are_recorded_once_each():
    text = "card 4111 1111 1111 1111 then 5500-0000-0000-0004 end"
    guard = OutputGuard(RULES, ["nasty", "pii"])
    emitted, result = stream(guard, list(text))
    assert emitted == text and result is None
    assert [f.matched_rule for f in guard.flagged] == ["card", "card"]
    assert all(f.flagged and not f.blocked and f.categories["pii"] for f in guard.flagged)


def test_rules_for_input_only_do_not_touch_output():
    guard = OutputGuard([RULES[2]])
    assert guard.feed("hello") == ("hello", None)  # no output rules: nothing is held back
    assert guard.finish() == "" and guard.blocked is None

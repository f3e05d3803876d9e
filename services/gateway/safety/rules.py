"""Safety rules: keywords or regular expressions that block or flag text, compiled once at load.

Every rule compiles to one regex, so input checks and the streaming output guard match the same way.
Keywords are case-insensitive and, by default, whole words only. Each rule knows the longest text a
match can span (`max_match_chars`): the output guard holds back that much of a stream.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Literal, Sequence

from .classifier import ModerationResult, merge

WHERE = ("input", "output")


class SafetyPolicyError(ValueError):
    """A safety policy that cannot be loaded; the message names the file and the rule."""


@dataclass
class RuleConfig:
    name: str
    kind: Literal["keyword", "regex"]
    match: str | list[str]                         # one or more keywords or regexes (any of them matches)
    category: str
    action: Literal["block", "flag"] = "block"
    applies_to: list[Literal["input", "output"]] = field(default_factory=lambda: list(WHERE))
    word_boundary: bool = True                     # keywords: only whole words match
    max_match_chars: int | None = None             # regexes: the longest text a match can span (default: the policy's)


@dataclass(frozen=True)
class Rule:
    name: str
    category: str
    blocks: bool                                   # block, else flag
    applies_to: frozenset[str]
    pattern: re.Pattern[str]
    max_match_chars: int

    def result(self, categories: Iterable[str] = ()) -> ModerationResult:
        return ModerationResult.hit(self.name, self.category, self.blocks, categories)


def compile_rule(cfg: RuleConfig, default_max_match_chars: int, where: str) -> Rule:
    where = f"{where} rule {cfg.name!r}"
    alternatives = [cfg.match] if isinstance(cfg.match, str) else list(cfg.match)
    if not alternatives or any(not a for a in alternatives):
        raise SafetyPolicyError(f"{where}: match must hold non-empty keywords or regexes")
    if cfg.kind == "keyword":
        edge = r"(?<!\w)", r"(?!\w)"
        body = "|".join(re.escape(k) for k in alternatives)
        source = f"{edge[0]}(?:{body}){edge[1]}" if cfg.word_boundary else f"(?:{body})"
        pattern = re.compile(source, re.IGNORECASE)
        longest = max(len(k) for k in alternatives)
    else:
        try:
            pattern = re.compile("|".join(f"(?:{a})" for a in alternatives))
        except re.error as e:
            raise SafetyPolicyError(f"{where}: invalid regex: {e}") from e
        longest = cfg.max_match_chars or default_max_match_chars
    if pattern.match("") is not None:
        raise SafetyPolicyError(f"{where}: the pattern matches empty text, so it would match everything")
    if longest < 1:
        raise SafetyPolicyError(f"{where}: max_match_chars must be positive")
    if not cfg.applies_to:
        raise SafetyPolicyError(f"{where}: applies_to must name input, output or both")
    return Rule(cfg.name, cfg.category, cfg.action == "block", frozenset(cfg.applies_to), pattern, longest)


class RuleSet:
    """Rules as a classifier over whole texts (the request's messages)."""

    def __init__(self, rules: Sequence[Rule], categories: Sequence[str]) -> None:
        self.rules = tuple(rules)
        self.categories = tuple(categories)

    async def classify(self, text: str) -> ModerationResult:
        return merge([r.result(self.categories) for r in self.rules if r.pattern.search(text)], self.categories)

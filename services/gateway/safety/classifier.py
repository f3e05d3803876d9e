"""Moderation results, shaped like OpenAI's /v1/moderations, and the pluggable classifier interface.

Rules are one classifier; others (a moderation model behind HTTP, say) plug in through the policy
YAML as `factory: "package.module:Name"` plus `options`, called as Name(**options).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence


@dataclass
class ModerationResult:
    flagged: bool                         # something matched (a block or a flag)
    blocked: bool                         # the request or stream must stop (finish_reason content_filter)
    categories: dict[str, bool]
    category_scores: dict[str, float]
    matched_rule: str | None              # the rule that decided: the first blocking one, else the first flagging one

    @classmethod
    def clean(cls, categories: Iterable[str] = ()) -> ModerationResult:
        names = list(categories)
        return cls(False, False, {c: False for c in names}, {c: 0.0 for c in names}, None)

    @classmethod
    def hit(cls, rule: str, category: str, blocked: bool, categories: Iterable[str] = ()) -> ModerationResult:
        result = cls.clean(categories)
        result.flagged, result.blocked, result.matched_rule = True, blocked, rule
        result.categories[category], result.category_scores[category] = True, 1.0
        return result


class Classifier(Protocol):
    async def classify(self, text: str) -> ModerationResult:
        ...


def merge(results: Sequence[ModerationResult], categories: Iterable[str] = ()) -> ModerationResult:
    """One verdict from many: any block blocks, categories are or-ed, scores take the maximum."""
    merged = ModerationResult.clean(categories)
    for r in results:
        for name, hit in r.categories.items():
            merged.categories[name] = merged.categories.get(name, False) or hit
        for name, score in r.category_scores.items():
            merged.category_scores[name] = max(merged.category_scores.get(name, 0.0), score)
    deciding = next((r for r in results if r.blocked), None) or next((r for r in results if r.flagged), None)
    if deciding:
        merged.flagged, merged.blocked, merged.matched_rule = True, deciding.blocked, deciding.matched_rule
    return merged


@dataclass
class ClassifierConfig:
    factory: str                                   # "package.module:Name", called as Name(**options)
    options: dict[str, Any] = field(default_factory=dict)


def load_classifier(cfg: ClassifierConfig) -> Classifier:
    module_name, _, attr = cfg.factory.partition(":")
    if not module_name or not attr:
        raise ValueError(f"classifier factory must look like 'package.module:Name', got {cfg.factory!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"classifier factory {cfg.factory!r} cannot be imported: {e}") from e
    classifier = factory(**cfg.options)
    if not callable(getattr(classifier, "classify", None)):
        raise ValueError(f"classifier factory {cfg.factory!r} made an object without classify(text)")
    return classifier

"""Per-organization safety policies, loaded from YAML (see default_policy.yaml).

A file names policies (rules plus optional classifiers, possibly extending another policy), the
default policy, and which organizations use which policy. Input is checked whole, by rules and
classifiers together; output is checked while it streams, by rules only (see OutputGuard).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import yaml

from llmserve.config import ConfigError, from_dict

from .classifier import Classifier, ClassifierConfig, ModerationResult, load_classifier, merge
from .output_guard import OutputGuard
from .rules import Rule, RuleConfig, RuleSet, SafetyPolicyError, compile_rule

__all__ = ["SafetyPolicy", "SafetyPolicyError", "SafetyConfig", "PolicyConfig", "load_safety_policy"]


@dataclass
class PolicyConfig:
    extends: str | None = None                     # another policy whose rules and classifiers come first
    rules: list[RuleConfig] = field(default_factory=list)
    classifiers: list[ClassifierConfig] = field(default_factory=list)


@dataclass
class SafetyConfig:
    default_policy: str = "default"                # for organizations not listed in orgs
    max_match_chars: int = 64                      # default bound on a regex match (the output hold-back)
    policies: dict[str, PolicyConfig] = field(default_factory=dict)
    orgs: dict[str, str] = field(default_factory=dict)   # organization id -> policy name


@dataclass(frozen=True)
class _Policy:
    input_checks: tuple[Classifier, ...]           # the input rules as a RuleSet, then plugged classifiers
    output_rules: tuple[Rule, ...]
    categories: tuple[str, ...]


class SafetyPolicy:
    def __init__(self, cfg: SafetyConfig, where: str = "safety policy") -> None:
        policies = dict(cfg.policies)
        policies.setdefault("default", PolicyConfig())   # a permissive policy always exists
        for name, policy in policies.items():
            if policy.extends is not None and policy.extends not in policies:
                raise SafetyPolicyError(f"{where}: policy {name!r} extends unknown policy {policy.extends!r}")
        for org, name in [("default_policy", cfg.default_policy), *cfg.orgs.items()]:
            if name not in policies:
                raise SafetyPolicyError(f"{where}: {org} uses unknown policy {name!r}; known: {sorted(policies)}")
        self._default = cfg.default_policy
        self._orgs = dict(cfg.orgs)
        self._policies = {name: self._build(name, policies, cfg.max_match_chars, where) for name in policies}

    def policy_name(self, org_id: str) -> str:
        return self._orgs.get(org_id, self._default)

    async def check_input(self, org_id: str, texts: Sequence[str]) -> ModerationResult:
        """Every text through every check; blocked means refuse the request (finish_reason content_filter)."""
        policy = self._policies[self.policy_name(org_id)]
        results = await asyncio.gather(*(check.classify(text) for text in texts for check in policy.input_checks))
        return merge(results, policy.categories)

    def output_guard(self, org_id: str) -> OutputGuard:
        policy = self._policies[self.policy_name(org_id)]
        return OutputGuard(policy.output_rules, policy.categories)

    @staticmethod
    def _build(name: str, policies: dict[str, PolicyConfig], max_match_chars: int, where: str) -> _Policy:
        chain: list[str] = []
        while name is not None:
            if name in chain:
                raise SafetyPolicyError(f"{where}: policies extend each other in a cycle: {' -> '.join(chain + [name])}")
            chain.append(name)
            name = policies[name].extends
        rule_configs = [(n, r) for n in reversed(chain) for r in policies[n].rules]
        names = [r.name for _, r in rule_configs]
        if duplicates := sorted({n for n in names if names.count(n) > 1}):
            raise SafetyPolicyError(f"{where}: policy {chain[0]!r} has rules named alike: {duplicates}")
        rules = [compile_rule(r, max_match_chars, f"{where}: policy {n!r}") for n, r in rule_configs]
        categories = tuple(dict.fromkeys(r.category for r in rules))
        classifiers: list[Classifier] = []
        for n in reversed(chain):
            for c in policies[n].classifiers:
                try:
                    classifiers.append(load_classifier(c))
                except (ValueError, TypeError) as e:
                    raise SafetyPolicyError(f"{where}: policy {n!r}: {e}") from e
        input_rules = RuleSet([r for r in rules if "input" in r.applies_to], categories)
        return _Policy((input_rules, *classifiers),
                       tuple(r for r in rules if "output" in r.applies_to), categories)


def load_safety_policy(path: str | None) -> SafetyPolicy:
    """The policy in the YAML file at `path`; None gives a permissive policy with no rules."""
    if path is None:
        return SafetyPolicy(SafetyConfig())
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise SafetyPolicyError(f"safety policy {path}: cannot read it: {e}") from e
    try:
        cfg = from_dict(SafetyConfig, data, "") if isinstance(data, dict) else None
    except (ConfigError, TypeError) as e:  # TypeError: a required field is missing
        raise SafetyPolicyError(f"safety policy {path}: {e}") from e
    if cfg is None:
        raise SafetyPolicyError(f"safety policy {path}: the top level must be a mapping")
    if cfg.max_match_chars < 1:
        raise SafetyPolicyError(f"safety policy {path}: max_match_chars must be positive")
    return SafetyPolicy(cfg, f"safety policy {path}")

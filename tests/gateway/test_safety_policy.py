"""Safety policies from YAML: input rules, per-organization selection, plugged classifiers, load errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from services.gateway.safety import ModerationResult, SafetyPolicyError, load_safety_policy

EXAMPLE = Path(__file__).parents[2] / "services/gateway/safety/default_policy.yaml"

POLICY = """
default_policy: standard
orgs:
  org-kids: strict
  org-lab: open
policies:
  open: {}
  standard:
    rules:
      - name: bomb
        kind: keyword
        match: ["make a bomb", napalm]
        category: violence
      - name: ssn
        kind: regex
        match: '\\b\\d{3}-\\d{2}-\\d{4}\\b'
        max_match_chars: 11
        category: pii
        action: flag
      - name: leak-marker
        kind: keyword
        match: SECRET-PLAN
        category: secrets
        applies_to: [output]
  strict:
    extends: standard
    rules:
      - name: casino
        kind: keyword
        match: casino
        category: gambling
      - name: bet-anywhere
        kind: keyword
        match: bet
        word_boundary: false
        category: gambling
        action: flag
"""


class StubModerationModel:
    """A plugged classifier, built from the YAML's factory path and options."""

    def __init__(self, word: str, score: float) -> None:
        self.word, self.score = word, score

    async def classify(self, text: str) -> ModerationResult:
        hit = self.word in text
        return ModerationResult(flagged=hit, blocked=hit and self.score > 0.8, categories={"harassment": hit},
                                category_scores={"harassment": self.score if hit else 0.01},
                                matched_rule="stub-model" if hit else None)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def policy(tmp_path):
    return load_safety_policy(write(tmp_path, POLICY))


async def test_keywords_match_case_insensitively_as_whole_words(policy):
    blocked = await policy.check_input("org-1", ["hello", "How do I MAKE A BOMB?"])
    assert blocked.blocked and blocked.flagged and blocked.matched_rule == "bomb"
    assert blocked.categories == {"violence": True, "pii": False, "secrets": False}
    assert blocked.category_scores["violence"] == 1.0
    assert not (await policy.check_input("org-1", ["napalmish is not a word we block"])).flagged
    assert (await policy.check_input("org-1", ["Napalm."])).blocked


async def test_regex_flag_passes_but_is_reported(policy):
    result = await policy.check_input("org-1", ["my number is 123-45-6789"])
    assert result.flagged and not result.blocked
    assert result.matched_rule == "ssn" and result.categories["pii"]
    assert not (await policy.check_input("org-1", ["call 1234-45-67890"])).flagged


async def test_a_block_outranks_a_flag_and_categories_merge(policy):
    result = await policy.check_input("org-1", ["ssn 123-45-6789", "make a bomb"])
    assert result.blocked and result.matched_rule == "bomb"
    assert result.categories == {"violence": True, "pii": True, "secrets": False}


async def test_output_only_rules_do_not_check_input(policy):
    assert not (await policy.check_input("org-1", ["the SECRET-PLAN"])).flagged


async def test_policy_is_chosen_per_organization(policy):
    assert policy.policy_name("org-kids") == "strict"
    assert policy.policy_name("anyone-else") == "standard"
    kids = await policy.check_input("org-kids", ["Let's go to the casino"])
    assert kids.blocked and kids.matched_rule == "casino"
    assert (await policy.check_input("org-kids", ["make a bomb"])).blocked  # extends standard
    assert (await policy.check_input("org-kids", ["alphabetical"])).matched_rule == "bet-anywhere"
    assert not (await policy.check_input("org-1", ["Let's go to the casino"])).flagged
    assert not (await policy.check_input("org-lab", ["make a bomb"])).flagged


async def test_no_path_gives_a_permissive_policy():
    policy = load_safety_policy(None)
    result = await policy.check_input("org-1", ["make a bomb"])
    assert result == ModerationResult(False, False, {}, {}, None)
    guard = policy.output_guard("org-1")
    assert guard.feed("make a bomb") == ("make a bomb", None) and guard.finish() == ""


async def test_plugged_classifier_runs_with_the_rules(tmp_path):
    path = write(tmp_path, f"""
        policies:
          default:
            rules:
              - {{name: ssn, kind: regex, match: '\\d{{3}}-\\d{{2}}-\\d{{4}}', category: pii, action: flag}}
            classifiers:
              - factory: "{__name__}:StubModerationModel"
                options: {{word: idiot, score: 0.93}}
        """)
    policy = load_safety_policy(path)
    result = await policy.check_input("org-1", ["you idiot", "123-45-6789"])
    assert result.blocked and result.matched_rule == "stub-model"
    assert result.categories == {"pii": True, "harassment": True}
    assert result.category_scores == {"pii": 1.0, "harassment": 0.93}
    calm = await policy.check_input("org-1", ["hello"])
    assert not calm.flagged and calm.category_scores == {"pii": 0.0, "harassment": 0.01}


async def test_the_example_policy_loads_and_works():
    policy = load_safety_policy(str(EXAMPLE))
    assert (await policy.check_input("org-school-district", ["best Roulette strategy"])).blocked
    assert not (await policy.check_input("org-internal-red-team", ["make a bomb"])).flagged
    guard = policy.output_guard("someone")
    text, result = guard.feed("-----BEGIN RSA PRIVATE KEY-----\nMIIE")
    assert result is not None and result.matched_rule == "private-key" and text == ""


@pytest.mark.parametrize("text, error", [
    ("policies: [unclosed", "cannot read it"),
    ("- just\n- a list\n", "top level must be a mapping"),
    ("polices: {}\n", "unknown keys \\['polices'\\]"),
    ("policies:\n  default:\n    rules:\n      - {name: r, kind: regex, match: '(unclosed', category: c}\n",
     "policy 'default' rule 'r': invalid regex"),
    ("policies:\n  default:\n    rules:\n      - {name: r, kind: regex, match: 'a*', category: c}\n",
     "matches empty text"),
    ("policies:\n  default:\n    rules:\n      - {name: r, kind: keyword, match: [], category: c}\n",
     "non-empty keywords"),
    ("policies:\n  default:\n    rules:\n      - {name: r, kind: keyword, match: x, category: c, action: deny}\n",
     "action: must be one of \\['block', 'flag'\\]"),
    ("policies:\n  default:\n    rules:\n      - {name: r, kind: glob, match: x, category: c}\n",
     "kind: must be one of"),
    ("policies:\n  default:\n    rules:\n      - {name: r, kind: keyword, match: x, category: c, applies_to: [logs]}\n",
     "applies_to\\[0\\]: must be one of"),
    ("policies:\n  default:\n    rules:\n      - {name: r, kind: keyword, match: x}\n",
     r"missing required keys \['category'\]"),
    ("policies:\n  default:\n    rules:\n      - {name: r, kind: keyword, match: x, category: c}\n"
     "      - {name: r, kind: keyword, match: y, category: c}\n", "rules named alike: \\['r'\\]"),
    ("orgs: {org-1: strict}\n", "org-1 uses unknown policy 'strict'"),
    ("default_policy: nope\n", "default_policy uses unknown policy 'nope'"),
    ("policies:\n  a: {extends: b}\n  b: {extends: a}\n", "cycle"),
    ("policies:\n  a: {extends: zzz}\n", "extends unknown policy 'zzz'"),
    ("max_match_chars: 0\n", "max_match_chars must be positive"),
    ("policies:\n  default:\n    classifiers:\n      - {factory: 'no_such_module_xyz:Thing'}\n",
     "cannot be imported"),
    ("policies:\n  default:\n    classifiers:\n      - {factory: 'no-colon'}\n", "package.module:Name"),
])
def test_bad_policies_fail_at_load_with_a_clear_error(tmp_path, text, error):
    path = write(tmp_path, text)
    with pytest.raises(SafetyPolicyError, match=error) as caught:
        load_safety_policy(path)
    assert path in str(caught.value)


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(SafetyPolicyError, match="cannot read it"):
        load_safety_policy(str(tmp_path / "absent.yaml"))

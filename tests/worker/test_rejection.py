"""Draft verification: greedy exactness and the distribution of speculative sampling."""

from __future__ import annotations

import pytest
import torch

from services.worker.spec.rejection import rejection_sample, verify_greedy

VOCAB = 8
TRIALS = 20_000
# Four fixed-seed goodness-of-fit checks: a false alarm is about 1 in 2500; the bugs this catches
# (a residual that keeps the draft token, or ignores q) give p-values below 1e-300.
SIGNIFICANCE = 1e-4


def chi_square_p_value(tokens: list[int], probs: torch.Tensor) -> float:
    """Pearson's test that tokens were drawn from probs."""
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    expected = probs.double() * len(tokens)
    statistic = ((counts - expected) ** 2 / expected).sum()
    degrees_of_freedom = torch.tensor((VOCAB - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(degrees_of_freedom, statistic / 2))


def distributions(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, VOCAB, generator=g) * 2).exp().softmax(-1)


def one_hot(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), VOCAB).float()


@pytest.mark.parametrize("draft, target, expected", [
    ([4, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7]),     # all accepted, plus the bonus
    ([4, 5, 6], [4, 9, 6, 7], [4, 9]),           # mismatch at 1: one accepted, then the correction
    ([4, 5, 6], [1, 5, 6, 7], [1]),              # mismatch at 0
    ([], [3], [3]),
])
def test_verify_greedy(draft, target, expected):
    assert verify_greedy(draft, target) == expected


def test_verify_greedy_needs_one_more_target_token():
    with pytest.raises(ValueError, match="need len\\(draft_tokens\\) \\+ 1 = 3"):
        verify_greedy([1, 2], [1, 2])


def test_rejection_sampling_of_a_greedy_target_is_greedy_verification():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        target = torch.randint(0, VOCAB, (4,), generator=g).tolist()
        draft = [t if torch.rand((), generator=g) < 0.7 else (t + 1) % VOCAB for t in target[:3]]
        assert rejection_sample(draft, None, one_hot(target), g) == verify_greedy(draft, target)
        assert rejection_sample(draft, one_hot(draft), one_hot(target), g) == verify_greedy(draft, target)


def emitted(draft_probs: torch.Tensor | None, fixed_draft: list[int] | None) -> tuple[list[int], list[int]]:
    """First and (when emitted) second tokens over TRIALS speculative steps of two draft tokens."""
    target = distributions(3, seed=1)
    g = torch.Generator().manual_seed(2)
    if fixed_draft is None:
        drafts = torch.stack([torch.multinomial(draft_probs[i], TRIALS, replacement=True, generator=g)
                              for i in range(2)], dim=1).tolist()
    else:
        drafts = [fixed_draft] * TRIALS
    first, second = [], []
    for draft in drafts:
        out = rejection_sample(draft, draft_probs, target, g)
        first.append(out[0])
        if len(out) > 1:
            second.append(out[1])
    return first, second


def test_speculative_sampling_with_a_draft_distribution_matches_the_target():
    target, draft_probs = distributions(3, seed=1), distributions(2, seed=3)
    first, second = emitted(draft_probs, None)
    assert chi_square_p_value(first, target[0]) > SIGNIFICANCE
    assert chi_square_p_value(second, target[1]) > SIGNIFICANCE
    # The check has power: the draft's own distribution differs from the target and fails it.
    from_the_draft = torch.multinomial(draft_probs[0], TRIALS, replacement=True,
                                       generator=torch.Generator().manual_seed(4)).tolist()
    assert chi_square_p_value(from_the_draft, target[0]) < SIGNIFICANCE


def test_speculative_sampling_with_a_one_hot_draft_matches_the_target():
    target = distributions(3, seed=1)
    first, second = emitted(None, fixed_draft=[3, 5])
    assert chi_square_p_value(first, target[0]) > SIGNIFICANCE
    assert chi_square_p_value(second, target[1]) > SIGNIFICANCE
    assert 0 < first.count(3) < TRIALS        # the draft was accepted sometimes, not always


def test_a_draft_the_target_cannot_produce_is_always_rejected():
    target = distributions(2, seed=5)
    target[0, 6] = 0.0
    g = torch.Generator().manual_seed(0)
    outs = [rejection_sample([6], None, target, g) for _ in range(200)]
    assert all(len(out) == 1 and out[0] != 6 for out in outs)


def test_a_seeded_generator_repeats_the_outcome():
    target, draft_probs = distributions(4, seed=6), distributions(3, seed=7)
    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [rejection_sample([1, 2, 3], draft_probs, target, g) for _ in range(20)]
    assert run(11) == run(11)
    assert run(11) != run(12)


@pytest.mark.parametrize("draft, draft_probs, target_probs, message", [
    ([1, 2], None, torch.ones(2, VOCAB), "target_probs must be \\[len\\(draft_tokens\\) \\+ 1 = 3"),
    ([1, 2], None, torch.ones(3 * VOCAB), "target_probs must be"),
    ([1, 2], torch.ones(1, VOCAB), torch.ones(3, VOCAB), "draft_probs must be \\[2, 8\\]"),
    ([1, VOCAB], None, torch.ones(3, VOCAB), "draft tokens must be in \\[0, 8\\)"),
])
def test_bad_shapes_are_clear_errors(draft, draft_probs, target_probs, message):
    with pytest.raises(ValueError, match=message):
        rejection_sample(draft, draft_probs, target_probs, None)

"""Prompt-lookup proposals against hand-built contexts."""

from __future__ import annotations

import pytest

from services.worker.spec.ngram import NgramProposer


def test_proposes_what_followed_the_suffix():
    assert NgramProposer().propose([5, 6, 7, 8, 9, 1, 6, 7], k=3) == [8, 9, 1]


def test_prefers_the_most_recent_occurrence():
    context = [1, 2, 10, 11, 1, 2, 20, 21, 3, 1, 2]
    assert NgramProposer().propose(context, k=2) == [20, 21]


def test_prefers_a_longer_match_over_a_more_recent_one():
    #             3-gram [7, 1, 2] -> 30        2-gram [1, 2] -> 40 (more recent)
    context = [7, 1, 2, 30, 31, 8, 1, 2, 40, 41, 7, 1, 2]
    assert NgramProposer(max_n=3).propose(context, k=2) == [30, 31]
    assert NgramProposer(max_n=2).propose(context, k=2) == [40, 41]


def test_no_match_proposes_nothing():
    assert NgramProposer().propose([1, 2, 3, 4, 5], k=4) == []
    assert NgramProposer().propose([], k=4) == []
    assert NgramProposer().propose([7], k=4) == []


def test_min_n_rejects_shorter_matches():
    context = [1, 9, 5, 2, 9]           # only the 1-gram [9] recurs
    assert NgramProposer(min_n=1).propose(context, k=2) == [5, 2]
    assert NgramProposer(min_n=2).propose(context, k=2) == []


def test_k_truncates_and_the_context_end_cuts_short():
    context = [1, 2, 3, 4, 5, 6, 1, 2]
    proposer = NgramProposer()
    assert proposer.propose(context, k=1) == [3]
    assert proposer.propose(context, k=10) == [3, 4, 5, 6, 1, 2]
    assert proposer.propose(context, k=0) == []
    assert proposer.propose([4, 4, 4], k=5) == [4]    # the match ending just before the suffix


def test_long_context_finds_a_distant_match():
    context = [90, 91, 92, 93, 94, 95] + list(range(100, 20_000)) + [90, 91, 92]
    assert NgramProposer().propose(context, k=3) == [93, 94, 95]


@pytest.mark.parametrize("min_n, max_n", [(0, 3), (3, 2), (-1, 1)])
def test_bad_sizes_are_refused(min_n, max_n):
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(min_n, max_n)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="k must be >= 0"):
        NgramProposer().propose([1, 2, 1], k=-1)
    with pytest.raises(ValueError, match="one-dimensional"):
        NgramProposer().propose([[1, 2], [1, 2]], k=2)

"""The draft length follows the acceptance rate and pauses speculation that keeps failing."""

from services.worker.spec.adaptive import AdaptiveDraftLength


def test_full_length_while_drafts_are_accepted():
    policy = AdaptiveDraftLength()
    for _ in range(5):
        assert policy.next_k(4) == 4
        policy.record(4, 4)


def test_shrinks_then_pauses_then_probes_again():
    policy = AdaptiveDraftLength(pause_steps=3)
    policy.record(4, 1)                      # acceptance 0.625
    assert policy.next_k(4) == 3
    policy.record(3, 0)                      # 0.3125
    assert policy.next_k(4) == 2
    policy.record(2, 0)                      # 0.156 < 0.2: pause
    assert [policy.next_k(4) for _ in range(3)] == [0, 0, 0]
    assert policy.next_k(4) == 1             # probe with a short draft
    policy.record(1, 1)
    assert policy.next_k(4) > 1


def test_no_proposal_changes_nothing():
    policy = AdaptiveDraftLength()
    policy.record(0, 0)
    assert policy.next_k(5) == 5

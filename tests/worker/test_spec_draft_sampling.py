"""Speculative sampling with a draft model keeps the target's distribution exactly.

The engine's own path (ModelRunner with a DraftModelProposer: drafts drawn from q, q and p kept
aligned row by row, rejection sampling) runs over two bigram "models" of 8 tokens, whose next
token depends on the current one alone. The target's table P and the draft's Q differ, so drafts
are sometimes kept and sometimes corrected. Thousands of identical requests in one batch give the
samples for Pearson's test (tests/worker/test_rejection.py tests the sampler on its own)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from services.worker.engine.model_runner import Draft, ModelRunner
from services.worker.engine.request import Request
from services.worker.engine.sampler import Sampler
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import NewRequest, ScheduledRequest, SchedulerOutput
from services.worker.spec.draft_model import DraftModelProposer
from tests.worker.test_rejection import SIGNIFICANCE, VOCAB, chi_square_p_value, distributions

K = 3
TRIALS = 10_000
BLOCK_SIZE = 8     # the prompt token and K drafts fit in one block per request
LAST_PROMPT_TOKEN = 3


class Bigram(nn.Module):
    """Next-token logits from the current token alone; the KV cache is there but unused."""

    def __init__(self, probs: torch.Tensor):
        super().__init__()
        self.table = nn.Parameter(probs.log(), requires_grad=False)
        self.config = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1)

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.table[input_ids]

    def compute_logits(self, hidden):
        return hidden.float()


TARGET, DRAFT = distributions(VOCAB, seed=1), distributions(VOCAB, seed=3)


def speculate(alter=None) -> list[list[int]]:
    """One verification step of K drafts for each of TRIALS requests; -> the tokens each emitted.
    alter: changes each Draft between the draft model and the verification."""
    sampler = Sampler(torch.Generator().manual_seed(0))
    drafter = DraftModelProposer(Bigram(DRAFT), TRIALS + 1, BLOCK_SIZE, sampler)
    runner = ModelRunner(Bigram(TARGET), 1, 1, 1, TRIALS + 1, BLOCK_SIZE, torch.float32, torch.device("cpu"),
                         sampler, drafter=drafter)
    if alter is not None:
        propose = drafter.propose
        drafter.propose = lambda *args: {rid: alter(d) for rid, d in propose(*args).items()}
    batch = []
    for i in range(TRIALS):
        r = Request(f"r{i}", [LAST_PROMPT_TOKEN], SamplingParams(temperature=1.0), max_tokens=16, eos_token_ids=[])
        batch.append(ScheduledRequest(r, num_new_tokens=K + 1, num_spec_tokens=K, block_ids=[i + 1],
                                      new=NewRequest.of(r)))
    results = runner.execute(SchedulerOutput(batch))
    return [results[item.request.request_id].token_ids for item in batch]


@pytest.fixture(scope="module")
def emitted() -> list[list[int]]:
    return speculate()


def test_first_token_follows_the_target(emitted):
    assert chi_square_p_value([out[0] for out in emitted], TARGET[LAST_PROMPT_TOKEN]) > SIGNIFICANCE
    lengths = {len(out) for out in emitted}
    assert 1 in lengths and K + 1 in lengths      # drafts were corrected at times and kept whole at others


def test_later_tokens_follow_the_target_given_the_one_before(emitted):
    tested = 0
    for previous in range(VOCAB):
        following = [out[1] for out in emitted if len(out) > 1 and out[0] == previous]
        if len(following) >= 300:
            assert chi_square_p_value(following, TARGET[previous]) > SIGNIFICANCE, previous
            tested += 1
    assert tested >= 2


def test_q_raises_acceptance(emitted):
    # Verifying the same drafts as if deterministic (q one-hot) is exact too, but accepts a draft
    # with probability p instead of min(1, p / q).
    one_hot = speculate(lambda d: Draft(d.token_ids))
    assert chi_square_p_value([out[0] for out in one_hot], TARGET[LAST_PROMPT_TOKEN]) > SIGNIFICANCE
    assert sum(map(len, emitted)) > 1.1 * sum(map(len, one_hot))


def test_a_wrong_q_would_be_caught():
    wrong = speculate(lambda d: Draft(d.token_ids, d.probs.roll(1, dims=-1)))
    assert chi_square_p_value([out[0] for out in wrong], TARGET[LAST_PROMPT_TOKEN]) < SIGNIFICANCE

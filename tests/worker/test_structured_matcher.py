"""The grammar matcher and its masks on their own, with SmolLM2's tokenizer: draft walks leave the
matcher where it was, each mask row is what follows that draft prefix, a refused draft cannot
break the matcher, and a packed bitmask becomes a bias of -inf at exactly the tokens it clears."""

from __future__ import annotations

import json

import pytest
import torch

from services.worker.engine.sampling_params import Constraint
from services.worker.engine.structured.bitmask import bitmask_to_bias, bitmask_words
from services.worker.engine.structured.compiler import GrammarCompiler

PERSON = Constraint("json_schema", json.dumps({"type": "object", "properties": {"name": {"type": "string"}},
                                               "required": ["name"], "additionalProperties": False}))


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    return GrammarCompiler(smollm2_tokenizer, smollm2_tokenizer.vocab_size)


def allowed(bias: torch.Tensor) -> set[int]:
    return set(torch.isfinite(bias).nonzero().flatten().tolist())


def test_draft_masks_follow_each_prefix_and_roll_back(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    drafts = tok.encode('{"name": "Ada"}')
    matcher = compiler.matcher(PERSON)
    rows = matcher.masks(drafts)
    assert rows.shape == (len(drafts) + 1, tok.vocab_size) and set(rows.unique().tolist()) == {0.0, float("-inf")}
    assert matcher.num_tokens == 0 and matcher.valid_prefix(drafts) == len(drafts)   # walked and rolled back
    for j in range(len(drafts) + 1):
        assert torch.equal(rows[j], matcher.mask_after(drafts[:j]))
        if j < len(drafts):
            assert drafts[j] in allowed(rows[j])
    assert allowed(rows[-1]) == set(tok.eos_token_ids)   # complete: only EOS


def test_a_refused_draft_leaves_the_matcher_usable(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    good, bad = tok.encode('{"name'), tok.encode("hello")
    matcher = compiler.matcher(PERSON)
    rows = matcher.masks(good + bad)
    assert bad[0] not in allowed(rows[len(good)])
    assert (rows[len(good) + 1:] == 0).all()   # after the refused draft: never sampled from
    assert matcher.valid_prefix(good + bad) == len(good)
    assert all(matcher.accept(t) for t in tok.encode('{"name": "x"}')) and matcher.is_finished


def test_each_matcher_has_its_own_state(compiler, smollm2_tokenizer):
    a, b = compiler.matcher(PERSON), compiler.matcher(PERSON)
    assert a.accept(smollm2_tokenizer.encode("{")[0])
    assert a.num_tokens == 1 and b.num_tokens == 0
    assert not torch.equal(a.mask_after([]), b.mask_after([]))


def test_a_bitmask_becomes_minus_infinity_at_exactly_the_cleared_bits():
    vocab = 70
    mask = torch.zeros(2, bitmask_words(vocab), dtype=torch.int32)
    mask[0, 0] = 1 << 3
    mask[0, 2] = 1 << 5                      # token 69
    mask[1] = -1                             # all allowed (bits past the vocabulary ignored)
    bias = bitmask_to_bias(mask, vocab)
    assert bias.shape == (2, vocab) and bias.dtype == torch.float32
    assert allowed(bias[0]) == {3, 69} and (bias[0][[3, 69]] == 0).all()
    assert (bias[1] == 0).all()

"""The sampler against direct computations of what each option means."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.engine.sampler import TOP_P_CANDIDATES, Sampler, SamplingRow, _inverse_cdf
from services.worker.engine.sampling_params import SamplingParams

VOCAB = 32


def row(prompt=(1, 2, 3), output=(), seed=None, eos=(), **params) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator, list(eos))


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def sampler() -> Sampler:
    return Sampler(torch.Generator().manual_seed(1234))


def test_greedy_is_the_argmax_whatever_the_other_options():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    rows = [row(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3)] * 6
    assert sampler().sample(logits, rows).token_ids == logits.argmax(-1).tolist()
    probs = sampler().probs(logits, rows)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float())


def test_temperature_scales_the_logits():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    probs = sampler().probs(logits, [row(temperature=0.5), row(temperature=1.7)])
    torch.testing.assert_close(probs[0], (logits[0] / 0.5).softmax(-1))
    torch.testing.assert_close(probs[1], (logits[1] / 1.7).softmax(-1))


@pytest.mark.parametrize("options, kept", [
    (dict(top_k=1), [0]),
    (dict(top_k=3), [0, 1, 2]),
    (dict(top_k=100), [0, 1, 2, 3]),       # larger than the vocabulary: everything
    (dict(top_p=0.75), [0, 1]),           # 0.5 + 0.3 reaches 0.75
    (dict(top_p=0.85), [0, 1, 2]),
    (dict(top_p=0.1), [0]),               # never fewer than one token
    (dict(min_p=0.2), [0, 1, 2]),         # keeps p >= 0.2 * 0.5
    (dict(min_p=0.7), [0]),
    (dict(top_k=3, top_p=0.6), [0, 1]),   # top_p over the renormalised top 3
])
def test_truncation_keeps_exactly_the_expected_tokens_renormalised(options, kept):
    target = [0.3, 0.05, 0.5, 0.15]       # sorted: 2, 0, 3, 1
    by_rank = [2, 0, 3, 1]
    kept_ids = sorted(by_rank[r] for r in kept)
    probs = sampler().probs(logits_of(target), [row(**options)])[0]
    expected = torch.zeros(4)
    expected[kept_ids] = torch.tensor([target[i] for i in kept_ids])
    torch.testing.assert_close(probs, expected / expected.sum())


def reference_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    kept, mass = [], 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i].item()):
        if mass >= top_p:
            break
        kept.append(i)
        mass += probs[i].item()
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def test_top_p_over_a_large_vocabulary():
    # Wider than the candidates sorted first: the flat row needs the full sort, the peaked one not.
    vocab = 3 * TOP_P_CANDIDATES
    g = torch.Generator().manual_seed(8)
    logits = torch.stack([torch.randn(vocab, generator=g) * 0.1, torch.randn(vocab, generator=g) * 4])
    probs = sampler().probs(logits, [row(top_p=0.9), row(top_p=0.9)])
    for i in range(2):
        expected = reference_top_p(logits[i].softmax(-1), 0.9)
        assert torch.equal(probs[i] > 0, expected > 0)
        torch.testing.assert_close(probs[i], expected)


def test_rows_of_a_batch_are_processed_independently():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    rows = [row(top_k=5), row(temperature=0.0), row(top_p=0.6, temperature=0.8), row(min_p=0.1)]
    batched = sampler().probs(logits, rows)
    for i, r in enumerate(rows):
        torch.testing.assert_close(batched[i], sampler().probs(logits[i:i + 1], [r])[0])
    tokens = sampler().sample(logits, rows).token_ids
    assert tokens[1] == logits[1].argmax()
    assert all(batched[i, t] > 0 for i, t in enumerate(tokens))


def test_draws_follow_the_processed_distribution():
    draws = 20_000
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(5)).repeat(draws, 1)
    rows = [row(temperature=0.9, top_k=6)] * draws
    probs = sampler().probs(logits[:1], rows[:1])[0]
    counts = torch.bincount(torch.tensor(sampler().sample(logits, rows).token_ids), minlength=8)
    frequencies = counts / draws
    assert counts[probs == 0].sum() == 0
    # Each frequency within 5 standard deviations of its probability.
    assert ((frequencies - probs).abs() <= 5 * (probs * (1 - probs) / draws).sqrt() + 1e-9).all()


def test_a_draw_never_lands_on_a_token_of_no_mass_even_at_the_ends_of_the_unit_interval():
    probs = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.5, 0.0, 0.0],
                          [0.0, 0.0, 0.5, 0.0, 0.5, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    uniform = torch.stack([torch.tensor(0.0), below_one, below_one])[:, None]
    # u = 0 passes the zero-mass tokens before the first with mass; u just below 1 stops at the
    # last one with mass; a row of no mass stays inside the vocabulary.
    assert _inverse_cdf(probs, uniform).tolist() == [2, 4, 6]


def reference_penalties(logits: list[float], r: SamplingRow) -> list[float]:
    """A per-row transcription of the definitions (HF repetition, OpenAI presence/frequency)."""
    out = list(logits)
    p = r.params
    for t in set(r.prompt_token_ids) | set(r.output_token_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(r.output_token_ids):
        out[t] -= p.presence_penalty
    for t in r.output_token_ids:
        out[t] -= p.frequency_penalty
    return out


def test_penalties_match_a_per_row_reference():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, VOCAB, generator=g) * 3

    def tokens(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    rows = [
        row(prompt=tokens(20), output=tokens(15), repetition_penalty=1.3),
        row(prompt=tokens(20), output=tokens(15), presence_penalty=0.7, frequency_penalty=-0.4),
        row(prompt=tokens(5), output=tokens(30), presence_penalty=-1.0, frequency_penalty=1.5,
            repetition_penalty=0.8),
        row(prompt=tokens(20), output=tokens(15)),                      # no penalties
        row(prompt=tokens(20), output=[], repetition_penalty=2.0),       # prompt only
    ]
    probs = sampler().probs(logits, rows)
    for i, r in enumerate(rows):
        expected = torch.tensor(reference_penalties(logits[i].tolist(), r)).softmax(-1)
        torch.testing.assert_close(probs[i], expected)


def test_penalties_apply_to_greedy_rows_too():
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0]])
    assert sampler().sample(logits, [row(temperature=0.0)]).token_ids == [1]
    assert sampler().sample(logits, [row(output=[1], temperature=0.0, presence_penalty=0.5)]).token_ids == [2]


def test_seeded_rows_repeat_whatever_the_batch():
    logits = torch.zeros(1, 1000)    # uniform: every draw is decided by the generator

    def run(batch_size: int, position: int, seed: int) -> list[int]:
        rows = [row(seed=100 + i) for i in range(batch_size)]
        rows[position] = row(seed=seed)
        steps = [sampler().sample(logits.repeat(batch_size, 1), rows).token_ids[position] for _ in range(4)]
        return steps

    alone = run(1, 0, seed=42)
    assert run(5, 3, seed=42) == alone
    assert run(3, 0, seed=42) == alone
    assert len(set(alone)) > 1              # the generator advances with every draw
    assert run(1, 0, seed=43) != alone


def test_seeded_row_is_unaffected_by_unseeded_neighbours():
    logits = torch.zeros(3, 1000)
    first = sampler().sample(logits, [row(), row(seed=9), row()]).token_ids[1]
    again = Sampler(torch.Generator().manual_seed(99)).sample(logits, [row(), row(seed=9), row()]).token_ids[1]
    assert first == again


def test_unseeded_rows_use_the_shared_generator():
    logits = torch.zeros(4, 1000)
    a = Sampler(torch.Generator().manual_seed(5)).sample(logits, [row()] * 4).token_ids
    b = Sampler(torch.Generator().manual_seed(5)).sample(logits, [row()] * 4).token_ids
    c = Sampler(torch.Generator().manual_seed(6)).sample(logits, [row()] * 4).token_ids
    assert a == b and a != c


def test_min_tokens_suppresses_eos_and_stop_tokens():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])   # EOS 2 first, stop token 3 next
    def greedy(output):
        return sampler().sample(logits, [row(output=output, eos=[2], temperature=0.0, min_tokens=3,
                                             stop_token_ids=[3])]).token_ids[0]
    assert greedy([]) == 1
    assert greedy([1, 1]) == 1
    assert greedy([1, 1, 1]) == 2
    probs = sampler().probs(logits, [row(output=[0], eos=[2], min_tokens=2, stop_token_ids=[3])])[0]
    assert probs[2] == 0 and probs[3] == 0 and math.isclose(probs.sum().item(), 1.0, rel_tol=1e-6)


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(11))
    rows = [row(logprobs=True, top_logprobs=5, temperature=0.3, top_k=2, presence_penalty=1.0, output=[4]),
            row(logprobs=True),
            row()]
    result = sampler().sample(logits, rows)
    raw = logits.log_softmax(-1)
    for i, token in enumerate(result.token_ids):
        assert math.isclose(result.logprobs[i], raw[i, token].item(), rel_tol=1e-6)
    top = result.top_logprobs
    assert [len(t) for t in top] == [5, 0, 0]
    values, ids = raw[0].topk(5)
    assert [t for t, _ in top[0]] == ids.tolist()
    assert [v for _, v in top[0]] == sorted((v for _, v in top[0]), reverse=True)
    torch.testing.assert_close(torch.tensor([v for _, v in top[0]]), values)


def test_no_logprobs_unless_asked():
    result = sampler().sample(torch.randn(2, VOCAB), [row(), row(temperature=0.0)])
    assert result.logprobs is None and result.top_logprobs is None


def test_the_callers_logits_are_left_alone():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    rows = [row(output=[1, 1], frequency_penalty=1.0, top_k=3, min_tokens=5, eos=[0]), row(temperature=0.5)]
    sampler().sample(logits, rows)
    sampler().probs(logits, rows)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("logits, rows, message", [
    (torch.zeros(VOCAB), [row()], "must be \\[num_rows=1, vocab\\]"),
    (torch.zeros(2, VOCAB), [row()], "must be \\[num_rows=1, vocab\\]"),
    (torch.zeros(1, VOCAB, dtype=torch.long), [row()], "floating point"),
    (torch.zeros(1, VOCAB), [row(output=[VOCAB], presence_penalty=1.0)], "token ids must be in"),
    (torch.zeros(1, VOCAB), [row(prompt=[-1], repetition_penalty=1.2)], "token ids must be in"),
    (torch.zeros(1, VOCAB), [row(min_tokens=2, eos=[VOCAB + 5])], "stop and EOS token ids"),
])
def test_bad_input_is_a_clear_error(logits, rows, message):
    with pytest.raises(ValueError, match=message):
        sampler().sample(logits, rows)

"""Speculative decoding in the engine: n-gram proposals verified in one pass over the paged cache."""

from __future__ import annotations

import pytest

from services.worker.engine.sampling_params import SamplingParams
from tests.worker.test_engine import CHAT_PROMPTS, LONG_TEXT, chat_ids, greedy, make_engine, run

COPY_PROMPT = ("Repeat the following text exactly.\n\n" + LONG_TEXT[:600])


@pytest.fixture(scope="module")
def prompts(smollm2):
    tok = smollm2.tokenizer
    requests = {f"chat{i}": chat_ids(tok, p) for i, p in enumerate(CHAT_PROMPTS)}
    requests["copy"] = chat_ids(tok, COPY_PROMPT)
    requests["repeat"] = tok.encode("one two three four five one two three four five one two three")
    return requests


@pytest.fixture(scope="module")
def plain(smollm2, prompts):
    return run(make_engine(smollm2), {k: (ids, greedy(40)) for k, ids in prompts.items()})


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_output_is_identical_with_speculation(smollm2, prompts, plain, k):
    engine = make_engine(smollm2, num_speculative_tokens=k)
    spec = run(engine, {name: (ids, greedy(40)) for name, ids in prompts.items()})
    assert {n: r.tokens for n, r in spec.items()} == {n: r.tokens for n, r in plain.items()}
    assert {n: r.text for n, r in spec.items()} == {n: r.text for n, r in plain.items()}
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_copying_workload_accepts_drafts(smollm2, prompts):
    engine = make_engine(smollm2, num_speculative_tokens=4)
    engine.add_request("copy", prompts["copy"], greedy(60))
    proposed = accepted = 0
    while engine.has_work():
        for out in engine.step():
            proposed, accepted = out.spec_proposed, out.spec_accepted
    assert proposed > 0 and accepted / proposed > 0.3


def test_speculation_with_stops_max_tokens_and_abort(smollm2, prompts, plain):
    engine = make_engine(smollm2, num_speculative_tokens=4, num_blocks=64)
    start = engine.pool.num_free_blocks
    ref = plain["copy"]
    # max_tokens in the middle of an accepted run, and a stop token id from the reference.
    out = run(engine, {"len": (prompts["copy"], greedy(7)),
                       "stop": (prompts["copy"], greedy(40, stop_token_ids=[ref.tokens[9]]))})
    assert out["len"].tokens == ref.tokens[:7] and out["len"].finish == "length"
    first = ref.tokens.index(ref.tokens[9])
    assert out["stop"].tokens == ref.tokens[:first + 1] and out["stop"].finish == "stop"
    engine.add_request("abort", prompts["copy"], greedy(200))
    for _ in range(4):
        engine.step()
    engine.abort_request("abort")
    assert engine.pool.num_free_blocks == start


def test_speculation_survives_preemption(smollm2, prompts, plain):
    engine = make_engine(smollm2, num_speculative_tokens=3, num_blocks=18)
    names = ["copy", "chat0", "chat1", "chat2", "repeat"]
    out = run(engine, {n: (prompts[n], greedy(40)) for n in names})
    assert engine.scheduler.num_preemptions > 0
    assert {n: out[n].tokens for n in names} == {n: plain[n].tokens for n in names}


def test_sampled_speculation_runs_and_is_seeded(smollm2, prompts):
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=30, num_speculative_tokens=3)
    a = run(make_engine(smollm2), {"a": (prompts["copy"], params)})["a"]
    b = run(make_engine(smollm2), {"b": (prompts["copy"], params)})["b"]
    assert a.tokens == b.tokens and len(a.tokens) == 30

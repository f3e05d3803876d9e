"""Speculative decoding with a draft model, on the CPU: SmolLM2 as its own draft (almost every
draft accepted) and a random-weight draft (almost none). Greedy output must be what plain
decoding makes either way, through batching, prefix caching, preemption, stops and aborts, and
the draft's KV cache must mirror the target's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.worker.attention.torch_paged import TorchPagedAttention
from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine
from services.worker.engine.llm_engine import LLMEngine
from services.worker.engine.sampling_params import SamplingParams
from services.worker.model.loader import load_model
from tests.worker.test_engine import CHAT_PROMPTS, LONG_TEXT, chat_ids, greedy, make_engine, run

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def random_draft():
    """random:tiny: 2 layers, SmolLM2's vocabulary, weights that predict nothing."""
    return load_model("random:tiny", torch.float32, torch.device("cpu"), TorchPagedAttention(), seed=1)


@pytest.fixture(scope="module")
def prompts(smollm2):
    tok = smollm2.tokenizer
    requests = {f"chat{i}": chat_ids(tok, p) for i, p in enumerate(CHAT_PROMPTS[:6])}
    requests["long"] = chat_ids(tok, "Summarise this text in one sentence.\n\n" + LONG_TEXT[:500])
    return requests


@pytest.fixture(scope="module")
def plain(smollm2, prompts):
    return run(make_engine(smollm2), {name: (ids, greedy(MAX_TOKENS)) for name, ids in prompts.items()})


def draft_engine(target, draft, **engine_kwargs) -> LLMEngine:
    cfg = EngineConfig(**{"num_blocks": 256, "speculative_method": "draft_model", **engine_kwargs})
    return build_engine(ModelSourceConfig(), cfg, loaded=target, draft=draft).engine


def run_counting(engine: LLMEngine, requests, check=None):
    """run(), and the drafts proposed and accepted over all requests; check(engine) after each step."""
    counts = {}
    step = engine.step

    def counting_step():
        outputs = step()
        for out in outputs:
            counts[(out.request_id, out.index)] = (out.spec_proposed, out.spec_accepted)
        if check is not None:
            check(engine)
        return outputs

    engine.step = counting_step
    results = run(engine, requests)
    return results, sum(p for p, _ in counts.values()), sum(a for _, a in counts.values())


def draft_cache_mirrors_target(engine: LLMEngine) -> None:
    """With the target as its own draft, both caches hold the same keys and values in every slot
    the draft has computed: the invariant that makes shared and prefix-cached blocks valid."""
    runner, bs = engine.runner, engine.limits.block_size
    for r in engine.scheduler.running:
        blocks = engine.kv.block_ids(r.request_id)
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(r.num_computed_tokens - r.draft_lag)])
        for (k, v), (dk, dv) in zip(runner.kv_caches[::10], runner.drafter.kv_caches[::10]):
            for target, draft in ((k, dk), (v, dv)):
                flat, flat_draft = target.flatten(0, 1), draft.flatten(0, 1)
                torch.testing.assert_close(flat_draft[slots], flat[slots], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("k", [2, 4])
def test_same_model_draft_is_greedy_exact_and_accepted(smollm2, prompts, plain, k):
    engine = draft_engine(smollm2, smollm2, num_speculative_tokens=k)
    spec, proposed, accepted = run_counting(
        engine, {name: (ids, greedy(MAX_TOKENS)) for name, ids in prompts.items()})
    assert {n: r.tokens for n, r in spec.items()} == {n: r.tokens for n, r in plain.items()}
    assert {n: r.text for n, r in spec.items()} == {n: r.text for n, r in plain.items()}
    assert proposed > 0 and accepted / proposed > 0.9
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_random_draft_is_rejected_and_output_unchanged(smollm2, random_draft, prompts, plain):
    engine = draft_engine(smollm2, random_draft, num_speculative_tokens=3)
    spec, proposed, accepted = run_counting(
        engine, {name: (ids, greedy(MAX_TOKENS)) for name, ids in prompts.items()})
    assert {n: r.tokens for n, r in spec.items()} == {n: r.tokens for n, r in plain.items()}
    assert proposed > 0 and accepted / proposed < 0.2
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_prefix_cached_blocks_are_valid_for_the_draft(smollm2, prompts, plain):
    engine = draft_engine(smollm2, smollm2, num_speculative_tokens=3)
    ids = prompts["long"]
    first, _, _ = run_counting(engine, {"a": (ids, greedy(MAX_TOKENS))})
    # Two siblings admitted with the cached prompt, sharing its blocks in the same steps.
    params = greedy(MAX_TOKENS, n=2)
    second, proposed, accepted = run_counting(engine, {"b": (ids, params)}, check=draft_cache_mirrors_target)
    assert second["b#0"].cached >= 96
    assert first["a"].tokens == second["b#0"].tokens == second["b#1"].tokens == plain["long"].tokens
    assert accepted / proposed > 0.9     # the draft saw the cached prefix: no zeros or stale keys
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_preemption_recomputes_both_caches(smollm2, prompts, plain):
    engine = draft_engine(smollm2, smollm2, num_speculative_tokens=3, num_blocks=14)
    spec, proposed, accepted = run_counting(
        engine, {name: (ids, greedy(MAX_TOKENS)) for name, ids in prompts.items()},
        check=draft_cache_mirrors_target)
    assert engine.scheduler.num_preemptions > 0
    assert {n: r.tokens for n, r in spec.items()} == {n: r.tokens for n, r in plain.items()}
    assert accepted / proposed > 0.9
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_stops_max_tokens_and_abort_with_a_draft_model(smollm2, prompts, plain):
    engine = draft_engine(smollm2, smollm2, num_speculative_tokens=4, num_blocks=64)
    start = engine.pool.num_free_blocks
    ref = plain["long"]
    stop_string = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 4]
    out = run(engine, {"len": (prompts["long"], greedy(7)),
                       "stop": (prompts["long"], greedy(MAX_TOKENS, stop_token_ids=[ref.tokens[9]])),
                       "text": (prompts["long"], greedy(MAX_TOKENS, stop=[stop_string]))})
    assert out["len"].tokens == ref.tokens[:7] and out["len"].finish == "length"
    first = ref.tokens.index(ref.tokens[9])
    assert out["stop"].tokens == ref.tokens[:first + 1] and out["stop"].finish == "stop"
    assert out["text"].text == ref.text[:ref.text.index(stop_string)] and out["text"].finish == "stop"
    engine.add_request("abort", prompts["long"], greedy(200))
    engine.add_request("waiting", prompts["chat0"], greedy(200))
    for _ in range(3):
        engine.step()
    engine.abort_request("abort")
    engine.abort_request("waiting")
    assert engine.pool.num_free_blocks == start and not engine.has_work()


def test_sampled_draft_speculation_is_seeded(smollm2, prompts):
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=MAX_TOKENS, num_speculative_tokens=3)
    runs = [run_counting(draft_engine(smollm2, smollm2), {"a": (prompts["chat1"], params)}) for _ in range(2)]
    (a, proposed, accepted), (b, _, _) = runs
    assert a["a"].tokens == b["a"].tokens and len(a["a"].tokens) == MAX_TOKENS
    assert proposed > 0 and accepted / proposed > 0.5   # q equals p up to rounding: nearly all kept


def test_draft_model_configuration_errors(smollm2, random_draft):
    with pytest.raises(ValueError, match="unknown speculative_method 'eagle'"):
        build_engine(ModelSourceConfig(), EngineConfig(num_blocks=16, speculative_method="eagle"), loaded=smollm2)
    with pytest.raises(ValueError, match="needs engine.draft_model"):
        build_engine(ModelSourceConfig(), EngineConfig(num_blocks=16, speculative_method="draft_model"),
                     loaded=smollm2)
    other_vocab = replace(random_draft, config=replace(random_draft.config, vocab_size=1000))
    with pytest.raises(ValueError, match="must share the tokenizer"):
        draft_engine(smollm2, other_vocab)


def test_draft_model_from_its_source(smollm2):
    engine = build_engine(ModelSourceConfig(), EngineConfig(num_blocks=16, speculative_method="draft_model",
                                                            draft_model="random:tiny"), loaded=smollm2).engine
    assert engine.runner.drafter.model.config.name == "random:tiny"
    assert engine.proposer is None and engine.drafts_in_step

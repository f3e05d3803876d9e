"""The engine with the real SmolLM2 model on the CPU: correctness to the token, batching
invariance, prefix caching, chunked prefill, preemption, abort, sampling features."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import pytest
import torch

from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.async_engine import AsyncEngine
from services.worker.engine.build import build_engine
from services.worker.engine.llm_engine import LLMEngine
from services.worker.engine.sampling_params import SamplingParams

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "What is 12 times 7?",
    "Give me a synonym for happy.",
    "Translate 'good morning' into Spanish.",
]

LONG_TEXT = (
    "The history of computing is a story of abstraction layered upon abstraction. Early machines were "
    "programmed by rewiring panels; later, stored programs let the same hardware run many tasks. Assembly "
    "languages named the machine's instructions, compilers translated higher-level languages, and operating "
    "systems shared one computer among many users. Networks connected machines, and the web connected "
    "people. Each layer hid the details of the one below it, so that programmers could think about their "
    "problems instead of the machine. Today, large language models are served by systems that batch many "
    "requests together, page their memory in blocks, and route each request to the machine that has already "
    "seen its prefix. ") * 2


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    cached: int = 0
    logprobs: list = field(default_factory=list)


def make_engine(loaded, **engine_kwargs) -> LLMEngine:
    cfg = EngineConfig(**{"num_blocks": 256, **engine_kwargs})
    return build_engine(ModelSourceConfig(), cfg, loaded=loaded).engine


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Result]:
    results: dict[str, Result] = {}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    while engine.has_work():
        for out in engine.step():
            key = rid_key(out.request_id, out.index, requests[out.request_id][1].n)
            r = results.setdefault(key, Result())
            r.tokens += out.token_ids
            r.text += out.text
            r.logprobs += out.logprobs or []
            r.cached = out.num_cached_tokens
            if out.finished:
                r.finish = out.finish_reason
    return results


def rid_key(rid: str, index: int, n: int) -> str:
    return rid if n == 1 else f"{rid}#{index}"


def chat_ids(tokenizer, content: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": content}]))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="module")
def mixed_batch(tokenizer):
    """16 requests of varied prompt lengths (5 to ~300 tokens) and output lengths."""
    words = tokenizer.encode(LONG_TEXT)
    requests = {}
    for i in range(16):
        if i < 8:
            ids = chat_ids(tokenizer, CHAT_PROMPTS[i])
        else:
            ids = words[: 5 + (i - 8) * 40]
        requests[f"r{i}"] = (ids, greedy(8 + 3 * i))
    return requests


@pytest.fixture(scope="module")
def reference(smollm2, mixed_batch):
    """Each request's greedy output: a roomy engine, no prefix caching, no chunking."""
    engine = make_engine(smollm2, enable_prefix_caching=False, max_num_batched_tokens=4096)
    return run(engine, mixed_batch)


def test_greedy_matches_transformers_on_chat_prompts(smollm2, hf_smollm2, tokenizer):
    max_new = 32
    engine = make_engine(smollm2)
    prompts = {f"p{i}": (chat_ids(tokenizer, p), greedy(max_new)) for i, p in enumerate(CHAT_PROMPTS)}
    ours = run(engine, prompts)      # all 8 in one continuous batch
    for rid, (ids, _) in prompts.items():
        with torch.no_grad():
            out = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      pad_token_id=tokenizer.eos_token_ids[0])
        theirs = out[0, len(ids):].tolist()
        assert ours[rid].tokens == theirs, f"{rid}: {tokenizer.decode(ours[rid].tokens)!r} vs {tokenizer.decode(theirs)!r}"


@pytest.mark.parametrize("setting", [
    dict(enable_prefix_caching=True),
    dict(max_num_batched_tokens=16),
    dict(max_num_batched_tokens=48, enable_prefix_caching=True),
    dict(max_num_seqs=4),
])
def test_batched_output_equals_reference(smollm2, mixed_batch, reference, setting):
    results = run(make_engine(smollm2, **setting), mixed_batch)
    assert {k: r.tokens for k, r in results.items()} == {k: r.tokens for k, r in reference.items()}


def test_request_alone_equals_its_output_in_the_batch(smollm2, mixed_batch, reference):
    rid = "r11"
    alone = run(make_engine(smollm2), {rid: mixed_batch[rid]})
    assert alone[rid].tokens == reference[rid].tokens


def test_preemption_recomputes_to_the_same_output(smollm2, mixed_batch, reference):
    engine = make_engine(smollm2, num_blocks=40)        # 624 tokens of cache for ~2,000 in flight
    results = run(engine, mixed_batch)
    assert engine.scheduler.num_preemptions > 0
    assert {k: r.tokens for k, r in results.items()} == {k: r.tokens for k, r in reference.items()}
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_prefix_cache_hits_on_a_repeated_prompt(smollm2, tokenizer):
    engine = make_engine(smollm2)
    ids = tokenizer.encode(LONG_TEXT)[:100]
    first = run(engine, {"a": (ids, greedy(4))})
    second = run(engine, {"b": (ids, greedy(4))})
    assert first["a"].cached == 0 and second["b"].cached == 96
    assert second["b"].tokens == first["a"].tokens
    assert engine.kv.stats.hits == 96


def test_finish_and_abort_return_every_block(smollm2, tokenizer):
    engine = make_engine(smollm2, num_blocks=64)
    start = engine.pool.num_free_blocks
    ids = chat_ids(tokenizer, CHAT_PROMPTS[0])
    engine.add_request("finishing", ids, greedy(4))
    engine.add_request("running", ids, greedy(200))
    engine.add_request("waiting", tokenizer.encode(LONG_TEXT), greedy(10))
    for _ in range(3):
        engine.step()
    assert engine.pool.num_free_blocks < start
    engine.abort_request("running")
    engine.abort_request("waiting")
    while engine.has_work():
        engine.step()
    assert engine.pool.num_free_blocks == start
    assert not engine._requests and not engine._states


def test_seeded_sampling_is_reproducible(smollm2, tokenizer):
    ids = chat_ids(tokenizer, "Tell me a story about a dragon.")
    params = lambda seed: SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=24)  # noqa: E731
    engine = make_engine(smollm2)
    a = run(engine, {"a": (ids, params(7)), "noise": (ids[:20], SamplingParams(max_tokens=5))})
    b = run(engine, {"b": (ids, params(7))})
    c = run(engine, {"c": (ids, params(8))})
    assert a["a"].tokens == b["b"].tokens
    assert a["a"].tokens != c["c"].tokens


def test_stop_string_split_across_tokens_is_caught_and_not_emitted(smollm2, tokenizer):
    ids = chat_ids(tokenizer, CHAT_PROMPTS[0])
    engine = make_engine(smollm2)
    full = run(engine, {"full": (ids, greedy(20))})["full"]
    pieces = [tokenizer.decode([t]) for t in full.tokens]
    # A stop string that starts inside one token and ends inside the next.
    j = next(i for i in range(1, len(pieces)) if len(pieces[i - 1]) >= 3 and len(pieces[i]) >= 3)
    stop = pieces[j - 1][-2:] + pieces[j][:2]
    cut = run(engine, {"cut": (ids, greedy(20, stop=[stop]))})["cut"]
    assert cut.finish == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert stop not in cut.text


def test_stop_token_ids_and_max_tokens(smollm2, tokenizer):
    ids = chat_ids(tokenizer, CHAT_PROMPTS[0])
    engine = make_engine(smollm2)
    full = run(engine, {"f": (ids, greedy(20))})["f"]
    stop_at = full.tokens[3]
    stopped = run(engine, {"s": (ids, greedy(20, stop_token_ids=[stop_at]))})["s"]
    assert stopped.finish == "stop" and stopped.tokens == full.tokens[:4]
    short = run(engine, {"l": (ids, greedy(3))})["l"]
    assert short.finish == "length" and short.tokens == full.tokens[:3]


def test_min_tokens_suppresses_eos(smollm2, tokenizer):
    ids = chat_ids(tokenizer, CHAT_PROMPTS[0])
    engine = make_engine(smollm2)
    natural = run(engine, {"a": (ids, greedy(64))})["a"]
    assert natural.finish == "stop"
    forced = run(engine, {"b": (ids, greedy(64, min_tokens=len(natural.tokens) + 5))})["b"]
    assert len(forced.tokens) >= len(natural.tokens) + 5


def test_logprobs_are_a_distribution(smollm2, tokenizer):
    ids = chat_ids(tokenizer, CHAT_PROMPTS[1])
    result = run(make_engine(smollm2), {"a": (ids, greedy(8, logprobs=True, top_logprobs=5))})["a"]
    assert len(result.logprobs) == len(result.tokens)
    for lp in result.logprobs:
        assert lp.logprob <= 0
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and len(values) == 5
        assert lp.top[0][0] == lp.token_id                 # greedy picks the most likely
        assert math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-5)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-4


def test_n_choices_share_the_prompt_blocks(smollm2, tokenizer):
    ids = tokenizer.encode(LONG_TEXT)[:70]
    engine = make_engine(smollm2)
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=6)
    engine.add_request("multi", ids, params)
    engine.step()
    tables = [engine.kv.block_ids(f"multi#{i}") for i in range(3)]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]   # the 4 full prompt blocks are shared
    while engine.has_work():
        engine.step()
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


@pytest.mark.parametrize("ids,params,message", [
    ([], SamplingParams(), "empty"),
    ([1, 2, 10**6], SamplingParams(), "token ids"),
    ([1, 2, 3], SamplingParams(temperature=3.0), "temperature"),
    ([1, 2, 3], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2, 3], SamplingParams(max_tokens=10**6), "context length"),
    ([1] * 9000, SamplingParams(), "context length"),
    ([1, 2, 3], SamplingParams(n=100), "n must"),
    ([1, 2, 3], SamplingParams(top_logprobs=3), "needs logprobs"),
])
def test_bad_requests_are_refused_before_queueing(smollm2, ids, params, message):
    engine = make_engine(smollm2, num_blocks=600)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", ids, params)
    assert not engine.has_work()


async def test_async_engine_cancel_aborts_and_frees_blocks(smollm2, tokenizer):
    engine = make_engine(smollm2, num_blocks=64)
    start = engine.pool.num_free_blocks
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        ids = chat_ids(tokenizer, CHAT_PROMPTS[1])
        received = 0
        stream = async_engine.generate(ids, greedy(500, ignore_eos=True), "cancel-me")
        async for _ in stream:
            received += 1
            if received == 3:
                break
        await stream.aclose()
        for _ in range(100):
            if async_engine.stats.kv_blocks_used == 0 and not engine.has_work():
                break
            await asyncio.sleep(0.05)
        assert engine.pool.num_free_blocks == start
        # The engine keeps serving after the abort.
        outputs = [o async for o in async_engine.generate(ids, greedy(3))]
        assert outputs[-1].finish_reason == "length"
        with pytest.raises(ValueError):
            async for _ in async_engine.generate([], greedy(3)):
                pass
    finally:
        async_engine.stop()

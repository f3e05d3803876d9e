"""Overlap (async scheduling, engine_core.py): the next step is scheduled and submitted before the
results of the one in flight are applied, and the outputs are exactly those of the engine without
it, on a mixed workload with stop strings, max_tokens, stop tokens, seeded sampling, logprobs,
n > 1, aborts, chunked prefill and preemption in it."""

from __future__ import annotations

import math
import random

import pytest

from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine
from services.worker.engine.sampling_params import SamplingParams
from tests.worker.test_engine import CHAT_PROMPTS, LONG_TEXT, chat_ids, make_engine


def mixed_workload(tokenizer) -> list[tuple[str, list[int], SamplingParams, int | None]]:
    """(id, prompt, params, abort after this many tokens or None), in arrival order."""
    words = tokenizer.encode(LONG_TEXT)
    work = []
    for i in range(14):
        ids = chat_ids(tokenizer, CHAT_PROMPTS[i % 8]) if i % 2 else words[:20 + 23 * i]
        kind = i % 7
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=12 + i)
        elif kind == 1:
            params = SamplingParams(temperature=0.0, max_tokens=40, stop=[" the", "."])
        elif kind == 2:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=25, ignore_eos=True)
        elif kind == 3:
            params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=True, top_logprobs=3)
        elif kind == 4:
            params = SamplingParams(temperature=0.7, top_k=20, seed=7, n=2, max_tokens=18)
        elif kind == 5:
            params = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[13, 28])
        else:
            params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        work.append((f"r{i}", ids, params, 6 if i in (3, 10) else None))
    return work


def drive(engine, work, arrivals_per_step: int = 2) -> dict[str, dict]:
    """Arrivals a few a step, aborts once a request has shown enough tokens; -> per choice its
    tokens, text, finish reason and logprobs."""
    results: dict[str, dict] = {}
    pending, aborted = list(work), set()
    abort_after = {rid: n for rid, _, _, n in work if n is not None}
    while pending or engine.has_work():
        for rid, ids, params, _ in pending[:arrivals_per_step]:
            engine.add_request(rid, ids, params)
        del pending[:arrivals_per_step]
        for out in engine.step():
            r = entry(results, out)
            r["tokens"] += out.token_ids
            r["text"] += out.text
            r["logprobs"] += out.logprobs or []
            if out.finished:
                r["finish"] = out.finish_reason
            if (out.request_id in abort_after and out.request_id not in aborted
                    and len(r["tokens"]) >= abort_after[out.request_id]):
                aborted.add(out.request_id)
                for late in engine.abort_request(out.request_id):
                    entry(results, late)["finish"] = late.finish_reason
    return results


def entry(results: dict[str, dict], out) -> dict:
    return results.setdefault(f"{out.request_id}#{out.index}", {"tokens": [], "text": "", "finish": None,
                                                                "logprobs": []})


def same_outputs(a: dict[str, dict], b: dict[str, dict]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key]["tokens"], a[key]["text"], a[key]["finish"]) == \
            (b[key]["tokens"], b[key]["text"], b[key]["finish"]), key
        assert len(a[key]["logprobs"]) == len(b[key]["logprobs"]), key
        for x, y in zip(a[key]["logprobs"], b[key]["logprobs"]):
            assert x.token_id == y.token_id and math.isclose(x.logprob, y.logprob, abs_tol=1e-3), key
            assert [t for t, _ in x.top] == [t for t, _ in y.top], key


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


def test_overlap_gives_the_tokens_of_the_engine_without_it(smollm2, tokenizer):
    work = mixed_workload(tokenizer)
    # A small pool and budget: prefills are chunked and running requests get preempted.
    settings = dict(num_blocks=26, max_num_batched_tokens=96, max_num_seqs=8)
    plain = make_engine(smollm2, async_scheduling=False, **settings)
    overlapped = make_engine(smollm2, async_scheduling=True, **settings)
    expected = drive(plain, work)
    got = drive(overlapped, work)
    same_outputs(got, expected)
    finishes = {r["finish"] for r in expected.values()}
    assert {"stop", "length", "abort"} <= finishes                 # the workload reached every ending
    assert overlapped.scheduler.num_preemptions > 0 and plain.scheduler.num_preemptions > 0
    for engine in (plain, overlapped):
        assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
        assert not engine.core._requests and not engine.processor._states


def test_the_next_step_is_submitted_before_the_one_in_flight_is_collected(smollm2, tokenizer):
    engine = make_engine(smollm2, async_scheduling=True)
    calls = []
    submit, collect = engine.runner.submit, engine.runner.collect
    engine.runner.submit = lambda *a: calls.append("submit") or submit(*a)
    engine.runner.collect = lambda *a: calls.append("collect") or collect(*a)
    engine.add_request("a", chat_ids(tokenizer, CHAT_PROMPTS[0]), SamplingParams(temperature=0.0, max_tokens=5,
                                                                                 ignore_eos=True))
    tokens, steps = [], 0
    while engine.has_work():
        outputs = engine.step()
        steps += 1
        tokens += [t for o in outputs for t in o.token_ids]
    assert len(tokens) == 5
    # The first step only submits; each later one submits the next before it collects the last;
    # the step that would pass max_tokens is never scheduled, so the last call only collects.
    assert calls[:5] == ["submit", "submit", "collect", "submit", "collect"]
    assert calls.count("submit") == 5 and calls[-2:] == ["collect", "collect"]


def test_a_request_that_needs_its_tokens_on_the_host_turns_overlap_off(smollm2, tokenizer):
    prompt = chat_ids(tokenizer, CHAT_PROMPTS[1])
    work = [("penalised", prompt, SamplingParams(temperature=0.0, max_tokens=20, frequency_penalty=1.5), None),
            ("min", prompt, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=10), None),
            ("plain", prompt, SamplingParams(temperature=0.0, max_tokens=20), None)]
    expected = drive(make_engine(smollm2, async_scheduling=False), work, arrivals_per_step=3)
    engine = make_engine(smollm2, async_scheduling=True)
    calls = []
    submit = engine.runner.submit
    engine.runner.submit = lambda *a: calls.append(engine.core._in_flight is None) or submit(*a)
    same_outputs(drive(engine, work, arrivals_per_step=3), expected)
    assert all(calls[:12])                # nothing in flight at any submit while the penalised ran
    assert engine.core._num_sync_choices == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_overlap_on_a_random_workload_of_a_tiny_model(seed):
    """Arrivals, aborts, preemptions and max_tokens at random; a tiny random model (fast), many steps."""
    rng = random.Random(seed)
    work = []
    for i in range(40):
        prompt = [rng.randrange(10, 60) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=rng.randrange(1000),
                                max_tokens=rng.randint(1, 25), ignore_eos=True, n=rng.choice([1, 1, 2]))
        # An abort cuts every choice where they happen to be: only single choices are aborted.
        work.append((f"r{i}", prompt, params, rng.choice([None, None, 3]) if params.n == 1 else None))

    def engine(overlap: bool):
        return build_engine(ModelSourceConfig(source="random:tiny"),
                            EngineConfig(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=20,
                                         async_scheduling=overlap)).engine
    plain, overlapped = engine(False), engine(True)
    same_outputs(drive(overlapped, work, arrivals_per_step=1), drive(plain, work, arrivals_per_step=1))
    assert overlapped.scheduler.num_preemptions > 0
    assert overlapped.pool.num_free_blocks == overlapped.pool.num_usable_blocks

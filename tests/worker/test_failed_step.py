"""A step that fails mid-forward: the prefix cache never serves the KV it did not write, only the
requests the failure can be blamed on are aborted, and the others finish with the tokens they
would have had. Failures are injected into the real SmolLM2 engine on the CPU (a forward hook
that raises in a middle layer; a sampler that refuses one request's row)."""

from __future__ import annotations

import pytest

from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine
from services.worker.engine.sampling_params import SamplingParams
from tests.worker.test_engine import LONG_TEXT, run

POISON_SEED = 666   # the injected sampler fault refuses rows of this seed


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


def make_engine(loaded, **kw):
    return build_engine(ModelSourceConfig(), EngineConfig(**{"num_blocks": 128, **kw}), loaded=loaded).engine


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def fail_once_in_layer(engine, layer: int = 15):
    """The next forward pass raises in the given decoder layer, after the layers before it wrote KV."""
    def hook(module, args):
        handle.remove()
        raise RuntimeError("injected: the device went away mid-forward")
    handle = engine.runner.model.layers[layer].register_forward_pre_hook(hook)


def refuse_poisoned_rows(engine):
    """The sampler raises on any batch holding a row of POISON_SEED, as a per-request fault would
    (sample_on_device: the runner's plain rows and Sampler.sample both go through it)."""
    sample = engine.runner.sampler.sample_on_device

    def faulty(logits, rows):
        if any(row.params.seed == POISON_SEED for row in rows):
            raise RuntimeError("injected: this row's sampling state is unusable")
        return sample(logits, rows)
    engine.runner.sampler.sample_on_device = faulty


def step(engine):
    """One step as the async loop (async_engine.py) takes it: a step that raises is failed."""
    try:
        return engine.step()
    except Exception as error:
        return engine.fail_step(error)


def test_a_failed_forward_leaves_no_unwritten_block_in_the_prefix_cache(smollm2, tokenizer):
    ids = tokenizer.encode(LONG_TEXT)[:100]                      # 6 full blocks of 16
    expected = run(make_engine(smollm2), {"ref": (ids, greedy(6))})["ref"].tokens
    engine = make_engine(smollm2)
    start = engine.pool.num_free_blocks
    engine.add_request("a", ids, greedy(6))
    fail_once_in_layer(engine)
    outputs = step(engine)                                       # the prefill fails: nobody else to blame
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "abort")]
    assert engine.pool.num_free_blocks == start
    again = run(engine, {"b": (ids, greedy(6))})["b"]
    assert again.cached == 0                                     # a's blocks were never written
    assert again.tokens == expected


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failure_blamed_on_one_request_aborts_only_it(smollm2, tokenizer, overlap):
    words = tokenizer.encode(LONG_TEXT)
    prompts = {f"r{i}": words[7 * i:7 * i + 20 + 9 * i] for i in range(4)}
    params = {rid: greedy(8 + i) for i, rid in enumerate(prompts)}
    params["r3"] = SamplingParams(temperature=1.0, seed=11, max_tokens=10)   # seeded: must draw the same
    requests = {rid: (ids, params[rid]) for rid, ids in prompts.items()}
    expected = run(make_engine(smollm2), requests)
    engine = make_engine(smollm2, async_scheduling=overlap)
    start = engine.pool.num_free_blocks
    for rid, (ids, p) in requests.items():
        engine.add_request(rid, ids, p)
    tokens = {rid: [] for rid in requests}

    def collect(outputs):
        for o in outputs:
            tokens[o.request_id] += o.token_ids
    for _ in range(3):
        collect(step(engine))
    engine.add_request("poisoned", words[:30], SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=5))
    refuse_poisoned_rows(engine)
    outputs = step(engine)                    # the poisoned request joins the batch and its row fails
    # Overlapped, the step that was in flight is applied first: its outputs come too.
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finished or o.request_id == "poisoned"] \
        == [("poisoned", "abort")]
    assert len(outputs) == (1 + len(requests) if overlap else 1)
    collect([o for o in outputs if o.request_id != "poisoned"])
    while engine.has_work():
        collect(step(engine))
    assert tokens == {rid: r.tokens for rid, r in expected.items()}
    assert engine.pool.num_free_blocks == start
    assert not engine._requests and not engine._states


def test_a_step_that_fails_before_the_runner_takes_its_plan_leaks_no_batch_row(smollm2, tokenizer):
    words = tokenizer.encode(LONG_TEXT)
    engine = make_engine(smollm2)
    engine.add_request("short", words[:20], greedy(1))
    engine.add_request("long", words[20:50], greedy(10))
    step(engine)                                  # short finishes: the next plan tells the runner
    update = engine.runner.batch.update

    def refused(plan):
        engine.runner.batch.update = update
        raise RuntimeError("injected: the runner could not take the plan")
    engine.runner.batch.update = refused
    outputs = step(engine)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("long", "abort")]
    assert "short" in engine.runner.batch          # never told
    run(engine, {"next": (words[:12], greedy(3))})
    assert "short" not in engine.runner.batch and "long" not in engine.runner.batch
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks

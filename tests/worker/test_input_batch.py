"""The runner's persistent batch (services/worker/engine/input_batch.py) stays equal to what the
scheduler holds: after every step of a random mix of arrivals, chunked prefills, decodes,
n-gram speculation (with rejections), preemptions, finishes and aborts, each running request the
runner holds has the request's tokens and block table, and the runner holds nobody else once the
next plan has told it who left."""

from __future__ import annotations

import random

import numpy as np
import pytest

from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine
from services.worker.engine.input_batch import InputBatch
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import NewRequest, ScheduledRequest, SchedulerOutput
from services.worker.engine.request import Request


def check_batch(engine) -> None:
    batch, scheduler = engine.runner.batch, engine.scheduler
    for r in scheduler.running:
        if r.request_id not in batch:
            continue           # admitted, never yet planned (cannot happen after a step) or requeued
        row = batch.row(r.request_id)
        n = int(batch.num_tokens[row])
        assert batch.token_ids[row, :n].tolist() == r.all_token_ids, r.request_id
        table = engine.kv.block_ids(r.request_id)
        assert batch.block_table[row, :int(batch.num_blocks[row])].tolist() == table, r.request_id
        assert list(batch.sampling_row(row).output_token_ids) == r.output_token_ids


@pytest.mark.parametrize("seed", [0, 1])
def test_batch_follows_the_scheduler_through_a_random_workload(seed):
    rng = random.Random(seed)
    engine = build_engine(ModelSourceConfig(source="random:tiny"),
                          EngineConfig(num_blocks=20, block_size=4, max_num_seqs=6, max_num_batched_tokens=24,
                                       num_speculative_tokens=2)).engine
    # Repetitive prompts give the n-gram proposer drafts, most of them rejected by a random model.
    motifs = [[rng.randrange(10, 60) for _ in range(3)] for _ in range(4)]
    next_id, live, steps, proposed, accepted = 0, [], 0, 0, 0
    while steps < 120 and (engine.has_work() or next_id < 30):
        if next_id < 30 and rng.random() < 0.7:
            prompt = rng.choice(motifs) * rng.randint(1, 5) + [rng.randrange(10, 60)]
            params = SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=rng.choice([None, 7]),
                                    max_tokens=rng.randint(1, 30), ignore_eos=True)
            engine.add_request(f"r{next_id}", prompt, params)
            live.append(f"r{next_id}")
            next_id += 1
        if live and rng.random() < 0.08:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            proposed += out.spec_proposed if out.finished else 0
            accepted += out.spec_accepted if out.finished else 0
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        steps += 1
        check_batch(engine)
    while engine.has_work():
        for out in engine.step():
            proposed += out.spec_proposed if out.finished else 0
            accepted += out.spec_accepted if out.finished else 0
        check_batch(engine)
    assert engine.scheduler.num_preemptions > 0            # the workload reached the interesting paths
    assert proposed > accepted                              # drafts verified, some rejected
    # The last step's plan told the runner who left before it: nobody but the last batch remains.
    assert len(engine.runner.batch) <= engine.limits.max_num_seqs
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def _item(request: Request, num_new: int, block_ids: list[int], new: bool, block_start: int = 0):
    return ScheduledRequest(request, num_new, 0, block_ids, new=NewRequest.of(request) if new else None,
                            block_start=block_start)


def test_prepare_gathers_tokens_positions_slots_and_the_rows_to_sample():
    batch = InputBatch(block_size=4, rows=1, tokens=2, blocks=1)    # every array has to grow
    a = Request("a", list(range(10, 19)), SamplingParams(), max_tokens=4, eos_token_ids=[])   # 9 tokens
    b = Request("b", [50, 51], SamplingParams(), max_tokens=4, eos_token_ids=[])
    a.num_computed_tokens = 4          # a prefill chunk of 3 of its 9 tokens: nothing sampled
    plan = SchedulerOutput([_item(a, 3, [7, 3, 9], new=True), _item(b, 2, [5], new=True)])
    rows = batch.update(plan)
    step = batch.prepare(plan, rows, {})
    assert step.input_ids.tolist() == [14, 15, 16, 50, 51]
    assert step.positions.tolist() == [4, 5, 6, 0, 1]
    assert step.slot_mapping.tolist() == [3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2, 5 * 4 + 0, 5 * 4 + 1]
    assert step.samples.tolist() == [False, True] and step.sample_index.tolist() == [4]
    assert step.block_tables.tolist() == [[7, 3, 9], [5, 0, 0]]
    batch.resolve(batch.append_placeholders(rows[1:]), [52])
    # Next step: a goes on (no new block), b decodes into a new block; a leaves after it.
    a.num_computed_tokens, b.all_token_ids, b.num_computed_tokens = 7, [50, 51, 52], 2
    plan = SchedulerOutput([_item(a, 2, [7, 3, 9], new=False, block_start=3),
                            _item(b, 1, [5, 8], new=False, block_start=1)])
    step = batch.prepare(plan, batch.update(plan), {})
    assert step.input_ids.tolist() == [17, 18, 52] and step.positions.tolist() == [7, 8, 2]
    assert step.slot_mapping.tolist() == [3 * 4 + 3, 9 * 4 + 0, 5 * 4 + 2]
    assert batch.block_table[batch.row("b"), :2].tolist() == [5, 8]
    plan = SchedulerOutput([_item(b, 1, [5, 8], new=False, block_start=2)], finished_ids=["a"])
    batch.update(plan)
    assert "a" not in batch and len(batch) == 1


def test_a_plan_ahead_of_the_batch_is_refused():
    batch = InputBatch(block_size=4)
    r = Request("r", [1, 2, 3], SamplingParams(), max_tokens=4, eos_token_ids=[])
    plan = SchedulerOutput([_item(r, 3, [1], new=True)])
    batch.prepare(plan, batch.update(plan), {})
    r.num_computed_tokens = 3
    r.all_token_ids.append(4)            # the scheduler holds a token the runner never sampled
    plan = SchedulerOutput([_item(r, 1, [1], new=False, block_start=1)])
    with pytest.raises(RuntimeError, match="does not hold"):
        batch.prepare(plan, batch.update(plan), {})
    with pytest.raises(RuntimeError, match="does not hold it"):
        batch.update(SchedulerOutput([_item(Request("x", [1], SamplingParams(), 1, []), 1, [2], new=False)]))
    assert np.all(batch.num_tokens[batch.row("r")] == 3)

"""Block pool, prefix cache and scheduler logic, without a model."""

import pytest

from services.worker.engine.block_pool import BlockPool, NoFreeBlocks
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import Scheduler, SchedulerConfig
from services.worker.engine.step_results import StepResults

BS = 4


def make_request(rid, tokens, max_tokens=8, salt=""):
    return Request(rid, list(tokens), SamplingParams(temperature=0), max_tokens, [2], cache_salt=salt)


def make_scheduler(num_blocks=32, max_seqs=8, budget=64, caching=True):
    kv = KVCacheManager(BlockPool(num_blocks), BS, caching)
    return Scheduler(SchedulerConfig(max_seqs, budget), kv), kv


def sampled_tokens(out):
    """What a runner would return for the step `out`: token 100 + i as each sampling request's i-th."""
    sampling = [item.request for item in out.scheduled if item.samples]
    return StepResults(ids=[r.request_id for r in sampling], token_ids=[100 + r.num_output_tokens for r in sampling])


def run_step(sched):
    """One step through the scheduler's own interface, the model's tokens made up."""
    out = sched.schedule()
    sched.update_from_output(out, sampled_tokens(out), now=0.0)
    return out


def test_pool_hands_out_blocks_in_lru_order_and_never_the_null_block():
    pool = BlockPool(5)
    a = pool.allocate(4)
    assert sorted(b.block_id for b in a) == [1, 2, 3, 4]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.free([a[2], a[0]])            # freed first -> evicted first
    assert [b.block_id for b in pool.allocate(2)] == [a[2].block_id, a[0].block_id]


def test_pool_revives_a_freed_cached_block_and_evicts_its_hash_when_reused():
    pool = BlockPool(3)
    b1, b2 = pool.allocate(2)
    pool.register(b1, 123, (1, 2, 3, 4))
    pool.free([b1, b2])
    assert pool.lookup(123, (1, 2, 3, 4)) is b1
    assert pool.lookup(123, (9, 9, 9, 9)) is None   # same hash, other tokens: no hit
    pool.take([b1])
    assert b1.ref_count == 1 and pool.num_free_blocks == 1
    pool.free([b1])
    pool.allocate(2)                                   # reuses both: the hash must go
    assert pool.lookup(123, (1, 2, 3, 4)) is None


def test_freeing_twice_is_caught():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])


def test_identical_prompts_share_full_blocks_but_not_the_last_token():
    sched, kv = make_scheduler()
    prompt = list(range(1, 10))                        # 9 tokens: 2 full blocks + 1
    a, b = make_request("a", prompt), make_request("b", prompt)
    sched.add(a)
    sched.add(b)
    sched.schedule()                                   # both admitted in the same step
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert kv.block_ids("a")[:2] == kv.block_ids("b")[:2]
    assert kv.block_ids("a")[2] != kv.block_ids("b")[2]


def test_prompt_of_whole_blocks_recomputes_its_last_block():
    sched, kv = make_scheduler()
    prompt = list(range(1, 9))                         # exactly 2 blocks
    sched.add(make_request("a", prompt))
    run_step(sched)
    b = make_request("b", prompt)
    sched.add(b)
    sched.schedule()
    assert b.num_cached_tokens == 4                    # the last token's logits are needed


def test_cache_salt_isolates_prefixes():
    sched, _ = make_scheduler()
    prompt = list(range(1, 10))
    sched.add(make_request("a", prompt, salt="org1"))
    sched.add(make_request("b", prompt, salt="org2"))
    out = sched.schedule()
    assert all(s.request.num_cached_tokens == 0 for s in out.scheduled)


def test_chunked_prefill_respects_the_budget_and_decodes_go_first():
    sched, _ = make_scheduler(budget=8)
    short = make_request("short", [1, 2, 3])
    sched.add(short)
    run_step(sched)                                    # short prefilled, sampled once
    long = make_request("long", list(range(10, 30)))   # 20 tokens
    sched.add(long)
    out = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("short", 1), ("long", 7)]
    assert not out.scheduled[1].samples
    out = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("short", 1), ("long", 7)]
    out = run_step(sched)
    assert out.scheduled[1].num_new_tokens == 6 and out.scheduled[1].samples


def test_running_cap_and_fcfs():
    sched, _ = make_scheduler(max_seqs=2)
    for i in range(4):
        sched.add(make_request(f"r{i}", [1, 2, 3]))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]


def test_preemption_frees_the_newest_and_everything_returns():
    sched, kv = make_scheduler(num_blocks=7, caching=False)   # 6 usable blocks
    a, b = make_request("a", range(1, 9), max_tokens=20), make_request("b", range(20, 28), max_tokens=20)
    sched.add(a)
    sched.add(b)
    run_step(sched)                                    # 2 + 2 blocks + sampled tokens
    preempted = []
    for _ in range(12):
        out = run_step(sched)
        preempted += out.preempted
    assert preempted and preempted[0] is b             # the most recently admitted goes first
    assert b.num_preemptions >= 1
    for r in (a, b):
        sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_waiting_request_that_never_fits_does_not_block_finishing():
    sched, kv = make_scheduler(num_blocks=3, caching=False)    # 2 usable blocks = 8 tokens
    big = make_request("big", range(1, 13))            # needs 3 blocks
    sched.add(big)
    assert sched.schedule().scheduled == []
    sched.finish(big, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_work() and kv.pool.num_free_blocks == 2

"""Blocks wholly outside a sliding window (every layer sliding) go back to the pool while the
request runs; the block table keeps its positions with the null block in their place."""

from services.worker.attention.metadata import first_visible_position
from services.worker.engine.block_pool import BlockPool
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.request import RequestStatus
from services.worker.engine.scheduler import Scheduler, SchedulerConfig
from tests.worker.test_kv_cache import BS, make_request, run_step

WINDOW = 10


def make_scheduler(window, num_blocks=32, budget=8, caching=True):
    kv = KVCacheManager(BlockPool(num_blocks), BS, caching, sliding_window=window)
    return Scheduler(SchedulerConfig(8, budget), kv), kv


def test_blocks_before_the_window_of_each_step_are_released_as_it_goes():
    sched, kv = make_scheduler(WINDOW)
    request = make_request("a", range(1, 31), max_tokens=20)     # 30 tokens: prefill in chunks of 8
    sched.add(request)
    seen_released = 0
    for _ in range(14):
        out = run_step(sched)
        (item,) = out.scheduled
        ids = kv.block_ids("a")
        dead = first_visible_position(item.start_position, WINDOW) // BS
        assert ids[:dead] == [0] * dead                          # released: the null block
        assert 0 not in ids[dead:]                               # the window's blocks are live
        assert len(ids) == -(-(item.start_position + item.num_new_tokens) // BS)
        assert kv.pool.num_used_blocks == len(ids) - dead
        seen_released = max(seen_released, dead)
    assert seen_released >= 6
    # Live blocks stay bounded by the window plus one step's tokens, not the context.
    assert kv.pool.num_used_blocks <= -(-(WINDOW + 8) // BS) + 1
    sched.finish(request, RequestStatus.FINISHED_ABORTED)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks   # nothing freed twice or leaked


def test_released_blocks_stay_findable_in_the_prefix_cache():
    sched, kv = make_scheduler(WINDOW, budget=64)
    prompt = list(range(1, 31))
    a = make_request("a", prompt, max_tokens=4)
    sched.add(a)
    run_step(sched)                                  # the whole prompt in one step: nothing dead yet
    first_blocks = kv.block_ids("a")[:2]
    for _ in range(3):
        run_step(sched)                              # decodes: the early blocks fall out of the window
    assert kv.block_ids("a")[:2] == [0, 0]
    b = make_request("b", prompt)
    sched.add(b)
    sched.schedule()
    assert b.num_cached_tokens == 28                 # its prefix found, released blocks included
    assert kv.block_ids("b")[:2] == [0, 0]           # and released again at once for b
    assert first_blocks[0] not in kv.block_ids("b")


def test_preemption_after_release_returns_every_block():
    sched, kv = make_scheduler(WINDOW, num_blocks=9, caching=False)   # 8 usable blocks
    a = make_request("a", range(1, 9), max_tokens=40)
    b = make_request("b", range(20, 28), max_tokens=40)
    sched.add(a)
    sched.add(b)
    for _ in range(30):
        run_step(sched)
    # With the window each request needs at most 4 blocks, so both keep running.
    assert a.num_preemptions == b.num_preemptions == 0 and a.num_output_tokens > 25
    for r in (a, b):
        sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_without_a_window_nothing_is_released():
    sched, kv = make_scheduler(None)
    sched.add(make_request("a", range(1, 31), max_tokens=20))
    for _ in range(10):
        run_step(sched)
    assert 0 not in kv.block_ids("a")

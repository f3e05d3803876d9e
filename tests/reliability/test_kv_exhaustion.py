"""KV cache exhaustion: more long requests than the cache holds, in one engine.

The engine must preempt (free a victim's blocks, recompute it later) rather than fail or stall,
every request must still finish with exactly the greedy output it has when run alone, and when
all are done every block is back in the pool with no reference left behind.
"""

from __future__ import annotations

import pytest

from tests.worker.test_engine import LONG_TEXT, greedy, make_engine, run

BLOCK_SIZE = 16
NUM_BLOCKS = 33            # 32 usable blocks = 512 tokens of KV cache
THREADS = 1                # on a busy 2-core machine two torch threads are ~8x slower than one
NUM_REQUESTS = 6
PROMPT_TOKENS = 96         # 6 blocks each: all six prompts fit (36 > 32 blocks is only reached while decoding)
MAX_TOKENS = 40            # each request ends at 136 tokens = 9 blocks; six need 54 blocks


@pytest.fixture(scope="module")
def long_requests(smollm2):
    words = smollm2.tokenizer.encode(LONG_TEXT * 2)
    # Distinct prompts (shifted windows), so the prefix cache cannot make them share blocks.
    return {f"long{i}": (words[i * 7: i * 7 + PROMPT_TOKENS], greedy(MAX_TOKENS, ignore_eos=True))
            for i in range(NUM_REQUESTS)}


def test_more_long_requests_than_the_cache_holds_all_finish_as_if_alone(smollm2, long_requests):
    needed = NUM_REQUESTS * -(-(PROMPT_TOKENS + MAX_TOKENS) // BLOCK_SIZE)
    assert needed > NUM_BLOCKS - 1, "the shape must overflow the cache"
    roomy = make_engine(smollm2, num_blocks=256, enable_prefix_caching=False, num_threads=THREADS)
    alone = {rid: run(roomy, {rid: request})[rid].tokens for rid, request in long_requests.items()}

    tight = make_engine(smollm2, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_threads=THREADS)
    together = run(tight, long_requests)

    assert tight.scheduler.num_preemptions > 0
    for rid in long_requests:
        assert together[rid].finish == "length"
        assert together[rid].tokens == alone[rid], f"{rid} differs from its output alone"
    stats = tight.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert all(block.ref_count == 0 for block in tight.pool.blocks)
    assert tight.pool.num_free_blocks == NUM_BLOCKS - 1
    assert not tight._requests and not tight._states   # no bookkeeping left for finished requests


def test_an_abort_during_preemption_churn_returns_every_block(smollm2, long_requests):
    engine = make_engine(smollm2, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_threads=THREADS)
    for rid, (ids, params) in long_requests.items():
        engine.add_request(rid, ids, params)
    aborted = set()
    for step in range(400):        # bounded: the whole load takes far fewer steps
        if not engine.has_work():
            break
        engine.step()
        if engine.scheduler.num_preemptions and not aborted:
            # Abort one running and one waiting (possibly preempted) request mid-flight.
            aborted = {engine.scheduler.running[0].request_id, engine.scheduler.waiting[-1].request_id}
            for rid in aborted:
                engine.abort_request(rid)
    assert aborted, "the load never preempted"
    assert not engine.has_work(), f"still busy after {step} steps"
    assert engine.pool.num_free_blocks == NUM_BLOCKS - 1
    assert all(block.ref_count == 0 for block in engine.pool.blocks)

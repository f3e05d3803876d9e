"""The worker's warm-up (engine/warm_up.py): made-up requests through the engine core before it
serves leave a measured step line and prefill rate in its load report, nothing running, no block
held and no prefix-cache figures, and change no user's tokens."""

from __future__ import annotations

from services.worker.engine.warm_up import warm_up
from tests.worker.test_engine import chat_ids, greedy, make_engine, run


def test_warm_up_measures_the_step_line_and_leaves_the_engine_as_it_was(smollm2):
    ids = chat_ids(smollm2.tokenizer, "Name three colours.")
    cold = make_engine(smollm2)
    assert cold.stats().load.decode_step_base_s == 0            # no line before a decode-only step
    expected = run(cold, {"a": (ids, greedy(12))})["a"].tokens

    engine = make_engine(smollm2)
    assert warm_up(engine.core) > 0
    stats = engine.stats()
    load = stats.load
    assert load.decode_step_base_s > 0 and load.decode_step_per_seq_s > 0 and load.prefill_tokens_per_s > 0
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    assert not engine.core._requests
    assert run(engine, {"a": (ids, greedy(12))})["a"].tokens == expected


def test_warm_up_fits_an_engine_of_one_sequence_and_a_short_context(smollm2):
    engine = make_engine(smollm2, max_num_seqs=1, max_model_len=8, max_num_batched_tokens=8)
    warm_up(engine.core)
    assert engine.stats().load.decode_step_base_s > 0
    assert engine.stats().kv_blocks_used == 0

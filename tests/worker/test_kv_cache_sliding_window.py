"""Blocks wholly outside a sliding window (every layer sliding) go back to the pool while the
request runs; the block table keeps its positions with the null block in their place, and the
attention backends stay exact while other requests reuse those blocks."""

import pytest
import torch

from services.worker.attention.backend import select_backend
from services.worker.attention.metadata import (
    AttentionMetadata, cache_slot, first_visible_position, padded_block_tables)
from services.worker.engine.block_pool import BlockPool
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.request import RequestStatus
from services.worker.engine.scheduler import Scheduler, SchedulerConfig
from tests.worker.test_kv_cache import BS, make_request, run_step, sampled_tokens

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
    a = make_request("a", prompt, max_tokens=8)
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


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_attention_stays_exact_while_released_blocks_are_reused(backend_name):
    """Two requests share a small pool: blocks the long one releases are handed to the other and
    overwritten, while the long one keeps decoding past them. Every step writes the scheduled
    tokens' keys and values through the block tables as the model runner does, and every query's
    windowed attention must equal dense attention over that request's own history."""
    heads, kv_heads, dim, window = 2, 1, 16, 6
    sched, kv = make_scheduler(window, num_blocks=7, budget=16, caching=False)   # 6 usable blocks
    backend = select_backend(backend_name, torch.device("cpu"))
    shape = (kv.pool.num_usable_blocks + 1, BS, kv_heads, dim)
    key_cache, value_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    gen = torch.Generator().manual_seed(0)
    history: dict[str, tuple[list, list]] = {}
    requests = [make_request("long", range(1, 15), max_tokens=24), make_request("short", range(50, 54), max_tokens=3)]
    sched.add(requests[0])
    owners: dict[int, set[str]] = {}
    for step in range(30):
        if step == 8:
            sched.add(requests[1])           # arrives once the long one has released blocks
        out = sched.schedule()
        if not out.scheduled:
            break
        spans = [(s.request.request_id, s.start_position, s.num_new_tokens, s.block_ids) for s in out.scheduled]
        for rid, start, n, ids in spans:
            keys, values = history.setdefault(rid, ([], []))
            keys += [torch.randn(kv_heads, dim, generator=gen) for _ in range(n)]
            values += [torch.randn(kv_heads, dim, generator=gen) for _ in range(n)]
            for b in ids[start // BS:]:
                owners.setdefault(b, set()).add(rid)
        slots = torch.tensor([cache_slot(ids, p, BS) for _, start, n, ids in spans for p in range(start, start + n)])
        new_k = torch.stack([history[rid][0][p] for rid, start, n, _ in spans for p in range(start, start + n)])
        new_v = torch.stack([history[rid][1][p] for rid, start, n, _ in spans for p in range(start, start + n)])
        query_lens, seq_lens = [n for _, _, n, _ in spans], [start + n for _, start, n, _ in spans]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(padded_block_tables([ids for *_, ids in spans]), dtype=torch.int32),
            slot_mapping=slots, max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=BS,
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        backend.write_kv(new_k, new_v, key_cache, value_cache, slots)
        query = torch.randn(starts[-1], heads, dim, generator=gen)
        out_rows = backend.attend(query, key_cache, value_cache, meta, 0.25, window=window)
        for (rid, start, n, _), row in zip(spans, starts):
            keys, values = (torch.stack(h) for h in history[rid])
            for j in range(n):
                lo, hi = max(0, start + j - window + 1), start + j + 1
                scores = torch.einsum("hd,td->ht", query[row + j], keys[lo:hi, 0]) * 0.25
                expected = torch.softmax(scores, -1) @ values[lo:hi, 0]
                torch.testing.assert_close(out_rows[row + j], expected, atol=1e-4, rtol=1e-4)
        sched.update_from_output(out, sampled_tokens(out), now=0.0)
    assert any(len(o) == 2 for o in owners.values())       # some block served both requests
    assert requests[0].num_output_tokens == 24 and requests[0].num_preemptions == 0


@pytest.mark.parametrize("setting", [dict(), dict(max_num_batched_tokens=8), dict(num_blocks=7)],
                         ids=["batched", "chunked-prefill", "small-pool"])
def test_engine_releasing_window_blocks_gives_the_same_tokens(setting, tmp_path, smollm2_tokenizer):
    """A tiny Mistral checkpoint (every layer slides, window 10, prompts up to 41 tokens) through
    the engine with engine.release_window_blocks on and off: the same greedy tokens, blocks really
    released on the way, and every block back in the pool at the end."""
    from tests.worker.families import WINDOW, load, prompts, save_checkpoint
    from tests.worker.test_engine import greedy, make_engine

    save_checkpoint(tmp_path, smollm2_tokenizer, "mistral", sliding_window=WINDOW)
    loaded = load(tmp_path)
    requests = prompts()
    outputs, released = {}, False
    for release in (False, True):
        engine = make_engine(loaded, release_window_blocks=release, **setting)
        assert engine.kv.sliding_window == (WINDOW if release else None)
        tokens = {rid: [] for rid in requests}
        for rid, ids in requests.items():
            engine.add_request(rid, ids, greedy(12, ignore_eos=True))
        while engine.has_work():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
            released |= any(0 in engine.kv.block_ids(rid) for rid in requests)
        assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
        outputs[release] = tokens
    assert released
    assert outputs[True] == outputs[False]

"""The prompt work a step takes beside its decodes: bounded so the step ends within
engine.max_step_time_s, or while tenants share the engine to engine.light_tenant_prefill_ratio times
its decodes' time (load_stats.prompt_budget, Scheduler.schedule), and shared in fair order,
so another tenant's newcomer is not kept behind a running request's next chunk."""

from __future__ import annotations

import pytest

from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.block_pool import BlockPool
from services.worker.engine.build import build_engine
from services.worker.engine.fair_queue import FairShare
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.load_stats import MIN_PROMPT_BUDGET, LoadStats
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import LIGHT_GRACE_STEPS, Scheduler, SchedulerConfig
from tests.worker.test_engine import greedy, make_engine
from tests.worker.test_fair_scheduler import _step
from tests.worker.test_kv_cache import run_step, sampled_tokens


def request(rid: str, prompt: int, tenant: str = "", max_tokens: int = 8) -> Request:
    return Request(rid, list(range(3, 3 + prompt)), SamplingParams(temperature=0), max_tokens, [2],
                   share=FairShare(tenant))


def scheduler(budget: int = 64, blocks: int = 256) -> Scheduler:
    return Scheduler(SchedulerConfig(8, budget), KVCacheManager(BlockPool(blocks), 4, False))


def tokens_of(out) -> dict[str, int]:
    return {item.request_id: item.num_new_tokens for item in out.scheduled}


def test_the_prompt_budget_bounds_chunks_and_admissions_but_not_decodes():
    sched = scheduler()
    sched.add(request("decoding", 4))
    run_step(sched)                                    # its prompt: it decodes from now on
    sched.add(request("long", 100))
    out = sched.schedule(prompt_budget=10)
    assert tokens_of(out) == {"decoding": 1, "long": 10}
    sched.update_from_output(out, sampled_tokens(out), now=0.0)
    sched.add(request("short", 6))
    out = sched.schedule(prompt_budget=10)             # the running chunk and the admission share it
    assert tokens_of(out) == {"decoding": 1, "long": 10}
    sched.update_from_output(out, sampled_tokens(out), now=0.0)
    assert tokens_of(run_step(sched)) == {"decoding": 1, "long": 63}   # no bound: the token budget's


def test_a_newcomer_of_another_tenant_is_prefilled_before_a_flood_s_next_chunk():
    sched = scheduler()

    def step(added: Request | None = None) -> dict[str, int]:
        if added:
            sched.add(added)
        out = sched.schedule(prompt_budget=48)
        sched.update_from_output(out, sampled_tokens(out), now=0.0)
        return tokens_of(out)

    assert step(request("a-long", 200, "A")) == {"a-long": 48}
    sched.add(request("b-short", 10, "B"))
    # B turns active at A's counter with nothing running: the step is B's prompt (and decodes) alone
    assert step(request("a-next", 10, "A")) == {"b-short": 10}
    # B runs now and A is behind: A's chunk goes first, B's newcomer waits its turn
    assert step(request("b-second", 10, "B")) == {"a-long": 48, "b-short": 1}
    # B's turn: its newcomer shares the step with A's chunk
    assert step() == {"a-long": 38, "b-short": 1, "b-second": 10}
    # within a tenant, the running request keeps its turn: a-next waits for a-long's prompt
    assert "a-next" not in step()


def test_a_newcomer_of_a_tenant_with_nothing_running_has_a_step_of_its_own():
    """Its first token waits for its prefill alone; A's decodes and chunk come in the next step."""
    sched = scheduler(budget=128)
    sched.add(request("a-decoding", 4, "A"))
    run_step(sched)
    sched.add(request("a-long", 200, "A"))
    assert tokens_of(run_step(sched)) == {"a-decoding": 1, "a-long": 127}
    sched.add(request("b-short", 10, "B"))
    sched.add(request("a-next", 10, "A"))
    assert tokens_of(run_step(sched)) == {"b-short": 10}
    assert tokens_of(run_step(sched)) == {"a-decoding": 1, "a-long": 73, "b-short": 1, "a-next": 10}
    sched.add(request("b-second", 10, "B"))            # B runs: its next newcomer takes its turn in the steps
    assert "a-decoding" in tokens_of(run_step(sched))


def test_newcomers_of_many_idle_tenants_share_one_own_step_and_the_next_step_decodes():
    sched = scheduler(budget=128)
    sched.add(request("a-decoding", 4, "A"))
    run_step(sched)
    for tenant in "BCD":
        sched.add(request(f"{tenant.lower()}-short", 50, tenant))
    assert tokens_of(run_step(sched)) == {"b-short": 50, "c-short": 50, "d-short": 28}
    # E's newcomer is idle too, but the streams decode first: beside its prompt (d-short's chunk yields)
    sched.add(request("e-short", 10, "E"))
    assert tokens_of(run_step(sched)) == {"a-decoding": 1, "b-short": 1, "c-short": 1, "e-short": 10}


def test_a_newcomer_that_cannot_get_blocks_holds_no_budget_back():
    sched = scheduler(blocks=31)                       # 30 usable blocks of 4 tokens
    sched.add(request("a-long", 100, "A"))
    run_step(sched)                                    # 64 tokens: 16 blocks, 14 left
    sched.add(request("b-big", 60, "B"))               # 15 blocks
    assert tokens_of(run_step(sched)) == {"a-long": 36}   # its rest, not 64 - 60 for one that cannot run


def fitted_stats() -> LoadStats:
    """Steps of 10 ms + 2 ms a decode, and 512 prompt tokens beside them at 0.25 ms a token."""
    stats = LoadStats()
    for i in range(100):
        decodes = (1, 2, 4, 8, 16)[i % 5]
        _step(stats, decodes, 0, 0.010 + 0.002 * decodes)
        if i % 5 == 0:
            _step(stats, decodes, 512, 0.010 + 0.002 * decodes + 0.128)
    return stats


def test_prompt_budget_is_what_the_decode_line_leaves_at_the_prefill_rate():
    assert LoadStats().prompt_budget(8, 0.2) is None             # nothing measured
    stats = fitted_stats()
    # 0.1 s left by 8 decodes' 26 ms: 74 ms of prompt at 4000 tokens/s
    assert stats.prompt_budget(8, 0.1) == pytest.approx(296, abs=1)
    assert stats.prompt_budget(0, 0.1) is None                   # nobody's pace to keep
    assert stats.prompt_budget(64, 0.1) == MIN_PROMPT_BUDGET     # decodes alone overrun it: prompts still move


def long_prompt_beside_a_decode(smollm2, long_tenant: str = "", decoding: int = 1, **engine_kwargs):
    """A 300-token prompt of long_tenant sent while `decoding` requests of tenant "" decode: the
    prompt's chunks and every answer."""
    long_ids = smollm2.tokenizer.encode("The history of paged memory in operating systems. " * 30)[:300]
    engine = make_engine(smollm2, **engine_kwargs)
    for i in range(decoding):
        engine.add_request(f"first{i}", [5 + i, 6, 7, 8], greedy(40))
    for _ in range(6):
        engine.step()                                  # its prompt, then decode-only steps
    engine.add_request("long", long_ids, greedy(4), share=FairShare(long_tenant))
    chunks, results = [], {}
    while engine.has_work():
        long = next((r for r in engine.scheduler.running if r.request_id == "long"), None)
        before = long.num_computed_tokens if long else 0
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.token_ids)
        long = next((r for r in engine.scheduler.running if r.request_id == "long"), None)
        if long is not None and long.num_computed_tokens > before and before < len(long_ids):
            chunks.append(long.num_computed_tokens - before)
    return chunks, results


def test_an_engine_bounds_prompt_chunks_beside_decodes_and_answers_the_same(smollm2):
    unbounded, expected = long_prompt_beside_a_decode(smollm2)
    assert unbounded[0] > MIN_PROMPT_BUDGET, unbounded
    bounded, results = long_prompt_beside_a_decode(smollm2, max_step_time_s=1e-3)
    assert max(bounded) == MIN_PROMPT_BUDGET, bounded  # 1 ms: the least budget, while "first" decodes
    assert results == expected


def test_the_light_tenant_ratio_bounds_prompt_work_only_while_a_light_tenant_is_served(smollm2):
    alone, expected = long_prompt_beside_a_decode(smollm2, decoding=4, light_tenant_prefill_ratio=1e-3)
    assert alone[0] > MIN_PROMPT_BUDGET, alone         # one tenant: the whole token budget
    light, results = long_prompt_beside_a_decode(smollm2, "B", decoding=4, light_tenant_prefill_ratio=1e-3)
    assert max(light) == MIN_PROMPT_BUDGET, light      # 1 request of B beside 4 of "": B is light
    floods, _ = long_prompt_beside_a_decode(smollm2, "B", decoding=1, light_tenant_prefill_ratio=1e-3)
    assert floods[0] > MIN_PROMPT_BUDGET, floods       # 1 beside 1: neither is light
    assert results == expected


def test_the_light_tenant_budget_is_that_many_times_the_decodes_time():
    stats = fitted_stats()
    # 8 decodes take 26 ms: at ratio 1, 26 ms of prompt at 4000 tokens/s; at 4, 104 ms
    assert stats.prompt_budget(8, decode_ratio=1.0) == pytest.approx(104, abs=1)
    assert stats.prompt_budget(8, decode_ratio=4.0) == pytest.approx(416, abs=2)
    assert stats.prompt_budget(0, decode_ratio=1.0) is None


def test_a_light_tenant_is_one_with_a_quarter_of_the_busiest_one_s_requests_or_fewer():
    sched = scheduler()
    for i in range(4):
        sched.add(request(f"a{i}", 4, "A"))
    assert not sched.serves_a_light_tenant()           # one tenant
    b = [request("b0", 4, "B")]
    sched.add(b[0])
    assert sched.serves_a_light_tenant()               # 1 of B beside 4 of A
    sched.finish(b[0], RequestStatus.FINISHED_ABORTED)  # A alone again: the grace counts down
    grace = [sched.serves_a_light_tenant() for _ in range(LIGHT_GRACE_STEPS)]
    assert grace == [True] * (LIGHT_GRACE_STEPS - 1) + [False]
    for i in range(2):
        b.append(request(f"b{i + 1}", 4, "B"))
        sched.add(b[-1])
    assert not sched.serves_a_light_tenant()           # 2 of B beside 4 of A: two floods


@pytest.mark.parametrize("ratio", [-1.0, 101.0])
def test_a_light_tenant_ratio_out_of_range_is_refused_at_start(ratio):
    with pytest.raises(ValueError, match="engine.light_tenant_prefill_ratio must be in"):
        build_engine(ModelSourceConfig(), EngineConfig(light_tenant_prefill_ratio=ratio))


@pytest.mark.parametrize("step_s", [-0.1, 61.0])
def test_a_step_time_out_of_range_is_refused_at_start(step_s):
    with pytest.raises(ValueError, match="engine.max_step_time_s must be in"):
        build_engine(ModelSourceConfig(), EngineConfig(max_step_time_s=step_s))

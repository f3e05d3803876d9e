"""The waiting queue's weighted fair order across tenants and priority within one, in the scheduler
(no model) and in a real worker process over gRPC; the load report's admission fields."""

from __future__ import annotations

import math
import threading
import time

import grpc
import pytest

from llmserve.v1 import worker_pb2 as pb
from llmserve.v1 import worker_pb2_grpc
from services.worker.engine.block_pool import BlockPool
from services.worker.engine.fair_queue import FairShare
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.load_stats import LoadStats
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import Scheduler, SchedulerConfig
from tests.worker.test_kv_cache import run_step
from tests.procs import worker

MODEL = "smollm2-135m-instruct"


def request(rid: str, tenant: str = "", weight: float = 1.0, priority: int = 0, prompt: int = 4,
            max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, prompt + 1)), SamplingParams(temperature=0), max_tokens, [2],
                   share=FairShare(tenant, weight, priority))


def scheduler(max_seqs: int = 1, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget), KVCacheManager(BlockPool(256), 4, False))


def serve(sched: Scheduler, steps: int) -> list[Request]:
    """Pretends the model ran for `steps` steps (through the scheduler's own update); returns the
    requests in the order they finished."""
    done = []
    for _ in range(steps):
        out = run_step(sched)
        done += [item.request for item in out.scheduled if item.request.finished]
    return done


def test_one_tenant_is_first_come_first_served_with_priority_first():
    sched = scheduler()
    for rid, priority in (("a", 0), ("b", 1), ("c", 0), ("d", -1)):
        sched.add(request(rid, priority=priority))
    assert [r.request_id for r in sched.waiting] == ["d", "a", "c", "b"]
    assert [r.request_id for r in serve(sched, 40)] == ["d", "a", "c", "b"]


def test_a_second_tenant_is_not_stuck_behind_a_flood():
    sched = scheduler()
    for i in range(6):
        sched.add(request(f"flood{i}", "A"))
    serve(sched, 3)                       # A's first is running and charged
    sched.add(request("short", "B"))
    order = [r.request_id for r in serve(sched, 60)]
    assert order.index("short") == 1, order   # right after the request that was running


def test_on_a_tie_a_tenant_with_nothing_running_goes_before_a_flood_s_queue():
    """B turns active at A's counter: its newcomer is the head, ahead of A's earlier arrivals."""
    sched = scheduler(max_seqs=2, budget=4)
    for i in range(3):
        sched.add(request(f"flood{i}", "A"))
    serve(sched, 1)                       # flood0 runs (the budget left admits no other)
    sched.add(request("short", "B"))
    assert sched.waiting.counter("B") == sched.waiting.counter("A")
    assert sched.waiting.peek().request_id == "short" and sched.waiting.head_tenant_idle()
    assert [item.request_id for item in run_step(sched).scheduled] == ["short"]   # a step of its own
    sched.add(request("short2", "B"))     # B runs, charged past A
    assert sched.waiting.peek().request_id == "flood1" and not sched.waiting.head_tenant_idle()


def test_equal_weights_alternate_and_two_to_one_weights_get_two_to_one():
    for weights, expected in (((1, 1), 1.0), ((2, 1), 2.0)):
        sched = scheduler()
        for i in range(30):
            sched.add(request(f"A{i}", "A", weights[0]))
            sched.add(request(f"B{i}", "B", weights[1]))
        done = serve(sched, 24 * 5)
        a = sum(r.share.tenant == "A" for r in done)
        b = sum(r.share.tenant == "B" for r in done)
        assert a + b >= 20 and abs(a / b - expected) <= 0.1 * expected + 1 / b, (weights, a, b)


def test_a_returning_tenant_banks_no_idle_time():
    sched = scheduler()
    sched.add(request("b0", "B"))
    serve(sched, 10)                      # B served and gone: forgotten
    assert sched.waiting.counter("B") is None
    for i in range(4):
        sched.add(request(f"A{i}", "A"))
    serve(sched, 12)                      # A builds up a counter
    sched.add(request("b1", "B"))
    assert sched.waiting.counter("B") == sched.waiting.counter("A")   # lifted, not 0
    for i in range(3):
        sched.add(request(f"b{2 + i}", "B"))
    order = [r.share.tenant for r in serve(sched, 80)]
    assert order[:4].count("A") >= 1      # B does not take the next four in a row


def test_preempted_request_goes_first_and_aborts_leave_no_trace():
    sched = scheduler(max_seqs=2)
    sched.add(request("a", "A"))
    serve(sched, 1)
    sched.add(request("b", "B"))
    sched.add(request("c", "B"))
    victim = sched.running[0]
    sched.running.remove(victim)
    sched._preempt(victim)
    assert sched.waiting.peek() is victim
    sched.finish(sched.waiting[-1], RequestStatus.FINISHED_ABORTED)   # c, waiting
    assert len(sched.waiting) == 2 and all(r.request_id != "c" for r in sched.waiting)
    done = serve(sched, 40)
    assert sorted(r.request_id for r in done) == ["a", "b"]
    assert len(sched.waiting) == 0 and sched.waiting.counter("A") is None and sched.waiting.counter("B") is None
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf"), 1e6])
def test_bad_weights_are_refused(weight):
    with pytest.raises(ValueError, match="tenant_weight"):
        FairShare.of("A", weight, 0)
    assert FairShare.of("A", 0.0, 3) == FairShare("A", 1.0, 3)


# -- a real worker ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    with worker(tmp_path_factory.mktemp("fair"), engine__max_num_seqs="1") as w, \
            grpc.insecure_channel(w.address) as channel:
        yield worker_pb2_grpc.GenerationStub(channel)


def generate(tenant: str, max_tokens: int, weight: float = 0.0) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=MODEL, chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Count.")]),
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                              tenant=tenant, tenant_weight=weight)


def test_worker_serves_a_second_tenant_before_the_first_ones_backlog(stub):
    finished: list[str] = []
    lock = threading.Lock()

    def run(name: str, req: pb.GenerateRequest) -> None:
        for _ in stub.Generate(req, timeout=120):
            pass
        with lock:
            finished.append(name)

    threads = []
    for i in range(4):
        threads.append(threading.Thread(target=run, args=(f"A{i}", generate("A", 24))))
        threads[-1].start()
        time.sleep(0.05)
    deadline = time.monotonic() + 30
    while stub.GetLoad(pb.GetLoadRequest()).waiting < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    threads.append(threading.Thread(target=run, args=("B", generate("B", 24))))
    threads[-1].start()
    for t in threads:
        t.join(120)
    assert len(finished) == 5 and finished.index("B") == 1, finished


def test_load_report_carries_what_admission_needs(stub):
    for _ in stub.Generate(generate("A", 16), timeout=60):
        pass
    load = stub.GetLoad(pb.GetLoadRequest())
    assert (load.max_num_seqs, load.max_num_batched_tokens, load.block_size) == (1, 512, 16)
    assert 0 < load.step_time_s < 5
    assert 0 < load.decode_tokens_per_s < 10_000 and 0 < load.prefill_tokens_per_s
    assert 0 < load.decode_step_base_s < 5 and load.decode_step_per_seq_s > 0   # one batch size: the prior
    assert 0 < load.prefill_time_share < 1                                     # its prompt, of the last seconds
    assert load.waiting_prompt_tokens == 0
    calls = [stub.Generate(generate("A", 64)) for _ in range(3)]
    deadline = time.monotonic() + 30
    while (load := stub.GetLoad(pb.GetLoadRequest())).waiting < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert load.waiting >= 2 and load.waiting_prompt_tokens >= 10 * load.waiting   # chat prompts queued
    for call in calls:
        call.cancel()


def test_worker_refuses_a_bad_tenant_weight(stub):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(generate("A", 4, weight=-2.0), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tenant_weight" in e.value.details()


class _Item:
    """What LoadStats reads of a scheduled request: a decode (one known token, sampled) or a chunk."""

    def __init__(self, prompt_tokens: int = 0) -> None:
        self.samples, self.num_known_tokens = prompt_tokens == 0, max(1, prompt_tokens)


def _idle_scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(8, 64), KVCacheManager(BlockPool(8), 16, enable_prefix_caching=True))


_ENDED: dict[int, float] = {}   # each LoadStats' wall clock: its steps run back to back


def _step(stats, decodes: int, prompt_tokens: int, seconds: float, idle_before: float = 0.0) -> None:
    ended = _ENDED[id(stats)] = _ENDED.get(id(stats), 0.0) + idle_before + seconds
    stats.record([_Item() for _ in range(decodes)] + ([_Item(prompt_tokens)] if prompt_tokens else []),
                 seconds, ended)


def test_the_decode_line_comes_from_decode_only_steps_and_prefill_from_the_rest():
    stats, idle = LoadStats(), _idle_scheduler()
    for i in range(200):
        decodes = (1, 2, 4, 8, 16)[i % 5]
        _step(stats, decodes, 0, 0.010 + 0.002 * decodes)
        if i % 7 == 0:   # a chunk of 256 prompt tokens beside the decodes: 0.5 ms a token
            _step(stats, decodes, 256, 0.010 + 0.002 * (decodes + 1) + 0.0005 * 256)
    snap = stats.snapshot(idle)
    assert (snap.decode_step_base_s, snap.decode_step_per_seq_s) == (pytest.approx(0.010), pytest.approx(0.002))
    # the prefill rate nets out the decode line's share of the step (not the chunk's own row)
    assert snap.prefill_tokens_per_s == pytest.approx(256 / (0.002 + 0.0005 * 256), rel=1e-6)


def test_a_burst_of_prefill_moves_neither_the_decode_line_nor_its_prior():
    """bench-load's burst: every step prefills for 20-30 s. Those steps' time is the prompts'."""
    stats, idle = LoadStats(), _idle_scheduler()
    _step(stats, 4, 512, 1.2)
    assert stats.snapshot(idle).decode_step_base_s == 0     # no decode-only step yet: no line
    for _ in range(20):
        _step(stats, 4, 0, 0.013)                           # one batch size: the prior splits the step at 4
    snap = stats.snapshot(idle)
    base, per_seq = snap.decode_step_base_s, snap.decode_step_per_seq_s
    assert base + 4 * per_seq == pytest.approx(0.013) and per_seq == pytest.approx(0.1 * (base + per_seq))
    for decodes in range(4, 30):
        _step(stats, decodes, 1024, 1.6)                    # 1.6 s steps of 1024 prompt tokens
    after = stats.snapshot(idle)
    assert (after.decode_step_base_s, after.decode_step_per_seq_s) == (base, per_seq)
    assert after.decode_tokens_per_s < 1                    # what the streams got meanwhile


def test_the_prefill_share_is_the_recent_wall_time_prompts_took():
    stats, idle = LoadStats(), _idle_scheduler()
    for decodes in range(1, 9):
        _step(stats, decodes, 0, 0.010 + 0.002 * decodes)  # a line, so a chunk's decodes are netted out
    assert stats.snapshot(idle).prefill_time_share == 0
    for _ in range(400):                                    # 60 s: every third step adds 0.1 s of prompt
        _step(stats, 8, 0, 0.026)
        _step(stats, 8, 0, 0.026)
        _step(stats, 8, 400, 0.126)
    assert stats.snapshot(idle).prefill_time_share == pytest.approx(0.1 / 0.178, rel=0.05)
    _step(stats, 8, 0, 0.026, idle_before=20.0)             # 20 s idle: two time constants
    assert stats.snapshot(idle).prefill_time_share == pytest.approx(0.1 / 0.178 * math.exp(-20.026 / 10), rel=0.05)

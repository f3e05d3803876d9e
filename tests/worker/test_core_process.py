"""The worker with its engine core in its own process (engine.engine_process, the default), as a
real process over real gRPC: the same greedy tokens as the in-process engine, stop strings that
never leak, cancellation that frees the core's blocks, bad input refused at the front end, and a
SIGKILLed core that ends its streams with UNAVAILABLE, turns health NOT_SERVING and takes the
worker down (for its supervisor to restart), never a hang."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.v1 import worker_pb2 as pb
from llmserve.v1 import worker_pb2_grpc
from services.worker.engine.sampling_params import SamplingParams
from tests.worker.core_procs import core_worker, engine_core_process
from tests.worker.test_engine import chat_ids, make_engine, run
from tests.worker.test_worker_grpc import MODEL, wait_idle

PROMPT = "Tell me about the ocean in three sentences."


@pytest.fixture(scope="module")
def running_worker(tmp_path_factory):
    with core_worker(tmp_path_factory.mktemp("core-worker")) as w:
        yield w


@pytest.fixture
def stub(running_worker):
    with grpc.insecure_channel(running_worker.address) as channel:
        yield worker_pb2_grpc.GenerationStub(channel)


def by_ids(ids: list[int], max_tokens: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIdsPrompt(ids=ids),
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling))


@pytest.fixture(scope="module")
def reference(smollm2):
    """The prompt's ids and 24 greedy tokens from the in-process engine (LLMEngine)."""
    ids = chat_ids(smollm2.tokenizer, PROMPT)
    out = run(make_engine(smollm2), {"ref": (ids, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))})
    return ids, out["ref"]


def test_the_engine_core_is_a_child_process(running_worker):
    core = engine_core_process(running_worker)
    assert core.cmdline()[-3] == "services.worker.engine.core_process"


def test_a_fresh_worker_reports_a_measured_step_line(stub):
    """The warm-up's (engine/warm_up.py): admission knows the pool before its first request."""
    load = stub.GetLoad(pb.GetLoadRequest())
    assert load.decode_step_base_s > 0 and load.decode_step_per_seq_s > 0 and load.prefill_tokens_per_s > 0
    assert (load.running, load.waiting, load.kv_blocks_used, load.prefix_cache_queries) == (0, 0, 0, 0)


def test_streams_the_in_process_engines_greedy_tokens(stub, reference):
    ids, ref = reference
    responses = list(stub.Generate(by_ids(ids, 24, ignore_eos=True), timeout=120))
    assert [t for r in responses for t in r.token_ids] == ref.tokens
    assert "".join(r.text for r in responses) == ref.text
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == 24


def test_a_stop_string_ends_the_stream_and_nothing_after_it_leaks(stub, smollm2, reference):
    ids, ref = reference
    pieces = [smollm2.tokenizer.decode(ref.tokens[:k]) for k in range(len(ref.tokens) + 1)]
    words = ref.text.split()
    stop = next(w for w in words[3:] if len(w) >= 4)            # a word well inside the answer
    needed = next(k for k, text in enumerate(pieces) if stop in text)   # tokens until the stop is complete
    responses = list(stub.Generate(by_ids(ids, 24, ignore_eos=True, stop=[stop]), timeout=120))
    text = "".join(r.text for r in responses)
    tokens = [t for r in responses for t in r.token_ids]
    assert text == ref.text[:ref.text.index(stop)]
    assert stop not in text
    assert tokens == ref.tokens[:len(tokens)] and len(tokens) <= needed
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    assert wait_idle(stub).kv_blocks_used == 0   # the core stopped it: its blocks are back


def test_n_choices_each_finish_once(stub, reference):
    ids, _ = reference
    request = by_ids(ids, 6, n=3, seed=5, ignore_eos=True)
    request.sampling.temperature = 1.0
    responses = list(stub.Generate(request, timeout=120))
    finished = [r.index for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted(finished) == [0, 1, 2]
    assert responses[-1].usage.completion_tokens == sum(len(r.token_ids) for r in responses) == 18


def test_cancel_mid_stream_frees_the_cores_blocks(stub, reference):
    ids, _ = reference
    call = stub.Generate(by_ids(ids, 2000, ignore_eos=True), timeout=120)
    for i, _ in enumerate(call):
        if i == 2:
            break
    assert stub.GetLoad(pb.GetLoadRequest()).kv_blocks_used > 0
    call.cancel()
    load = wait_idle(stub)
    assert load.kv_blocks_used == 0 and load.running == 0 and load.waiting == 0


@pytest.mark.parametrize("request_", [
    by_ids([1, 2, 10**6], 4),                                              # token id outside the vocabulary
    by_ids([1, 2, 3], 4, top_p=0.0),
    by_ids([1, 2, 3], 10**6),                                              # past the context length
    pb.GenerateRequest(model=MODEL, text="hi", sampling=pb.SamplingParams(max_tokens=4),
                       constraint=pb.Constraint(json_schema='{"type": "object", "properties": 5}')),
    pb.GenerateRequest(model=MODEL, text="hi", sampling=pb.SamplingParams(max_tokens=4),
                       constraint=pb.Constraint(regex="(unclosed")),
])
def test_bad_input_is_invalid_argument_and_the_core_keeps_serving(stub, reference, request_):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request_, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details()
    ids, ref = reference
    assert [t for r in stub.Generate(by_ids(ids, 3, ignore_eos=True), timeout=120) for t in r.token_ids] == ref.tokens[:3]


def health_status(address: str) -> int | None:
    """The worker's health, or None once nothing answers."""
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return None


def test_a_killed_engine_core_ends_the_streams_and_the_worker(tmp_path, reference):
    ids, _ = reference
    with core_worker(tmp_path) as w, grpc.insecure_channel(w.address) as channel:
        stub = worker_pb2_grpc.GenerationStub(channel)
        calls = [stub.Generate(by_ids(ids, 2000, ignore_eos=True), timeout=120) for _ in range(2)]
        for call in calls:
            assert next(call).token_ids   # both streams are running
        engine_core_process(w).send_signal(signal.SIGKILL)
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                for _ in call:
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "engine core" in e.value.details()
        not_serving = False
        while (status := health_status(w.address)) is not None:   # until the worker has gone
            if status == health_pb2.HealthCheckResponse.NOT_SERVING and not not_serving:
                not_serving = True
                with pytest.raises(grpc.RpcError) as e:   # new work is refused meanwhile, not queued
                    list(stub.Generate(by_ids(ids, 4), timeout=30))
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            time.sleep(0.1)
        assert not_serving
        assert w.process.wait(timeout=60) != 0, w.log()[-2000:]


def test_sigterm_drains_the_running_streams_then_stops_the_core(tmp_path, reference):
    ids, ref = reference
    with core_worker(tmp_path, server__grace_period_s="120") as w, grpc.insecure_channel(w.address) as channel:
        stub = worker_pb2_grpc.GenerationStub(channel)
        core = engine_core_process(w)
        call = stub.Generate(by_ids(ids, 24, ignore_eos=True), timeout=120)
        first = next(call)
        w.process.send_signal(signal.SIGTERM)   # the front end alone, as Kubernetes does
        rest = list(call)
        assert [t for r in [first, *rest] for t in r.token_ids] == ref.tokens
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert w.process.wait(timeout=60) == 0, w.log()[-2000:]
        core.wait(timeout=30)   # gone with the worker: stopped when asked, not killed
        assert not core.is_running() and "did not stop" not in w.log()

"""Tensor parallelism on the CPU: two ranks over gloo (services/worker/parallel).

Tiny random Llama (o_proj bias; one KV head, so it is replicated on both ranks) and Qwen3 (q/k
norms, two KV heads split) checkpoints, built by transformers (tests/worker/families.py), give
at tensor_parallel_size 2 the greedy tokens of tensor_parallel_size 1 (and of transformers, up
to its near-ties) under batching, chunked prefill, prefix caching and preemption, and through a
real gRPC worker. A rank killed mid-stream ends the stream with an error and the worker exits.
Sizes that do not divide the heads or exceed the devices are refused at start.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.v1 import worker_pb2 as pb
from llmserve.v1 import worker_pb2_grpc
from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine
from services.worker.parallel.driver import start_tensor_parallel
from tests.procs import worker
from tests.worker.families import ENGINE_SETTINGS, NEW_TOKENS, assert_matches, build_family, prompts
from tests.worker.test_engine import greedy, run

CASES = {
    "llama": ("llama", dict(attention_bias=True, num_key_value_heads=1)),
    "qwen3": ("qwen3", dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory, smollm2_tokenizer):
    return build_family(request.param, CASES, tmp_path_factory, smollm2_tokenizer)


def engine_tokens(folder: Path, tensor_parallel_size: int, **settings) -> tuple[dict[str, list[int]], dict]:
    """Greedy tokens of every prompt, each twice (the second from the prefix cache), in one engine
    built as the worker builds it; -> tokens, and facts about the run."""
    cfg = EngineConfig(**{"num_blocks": 64, "num_threads": 1, "tensor_parallel_size": tensor_parallel_size,
                          **settings})
    built = build_engine(ModelSourceConfig(source=str(folder), name="tiny", device="cpu"), cfg)
    try:
        engine = built.engine
        batch = {rid: (ids, greedy(NEW_TOKENS, ignore_eos=True)) for rid, ids in prompts().items()}
        first = run(engine, batch)
        again = run(engine, {f"{rid}-again": request for rid, request in batch.items()})
        facts = dict(cached=again["long-again"].cached, preemptions=engine.scheduler.num_preemptions,
                     leaked=engine.pool.num_usable_blocks - engine.pool.num_free_blocks)
        return {k: r.tokens for k, r in {**first, **again}.items()}, facts
    finally:
        if built.parallel is not None:
            built.parallel.stop()


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
def test_two_ranks_give_the_tokens_of_one(family, setting):
    case, folder, references = family
    one, _ = engine_tokens(folder, 1, **ENGINE_SETTINGS[setting])
    two, facts = engine_tokens(folder, 2, **ENGINE_SETTINGS[setting])
    for rid, ref in references.items():
        assert_matches(two[rid], ref, f"{case} {setting} TP 2 {rid}")
        assert two[f"{rid}-again"] == two[rid], f"{case} {setting} {rid}: a prefix-cache hit changed it"
    assert two == one, f"{case} {setting}: TP 2 differs from TP 1"
    assert facts["cached"] >= 32 and facts["leaked"] == 0, facts
    if setting == "preemption":
        assert facts["preemptions"] > 0


def _generate(stub, ids: list[int], max_tokens: int):
    return stub.Generate(pb.GenerateRequest(
        model="tiny", token_ids=pb.TokenIdsPrompt(ids=ids),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)), timeout=120)


def test_a_tensor_parallel_worker_over_grpc(family, tmp_path):
    case, folder, references = family
    with worker(tmp_path, model__source=str(folder), model__name="tiny", engine__num_blocks="64",
                engine__tensor_parallel_size="2") as w, grpc.insecure_channel(w.address) as channel:
        stub = worker_pb2_grpc.GenerationStub(channel)
        for rid, ids in prompts().items():
            tokens = [t for r in _generate(stub, ids, NEW_TOKENS) for t in r.token_ids]
            assert_matches(tokens, references[rid], f"{case} worker TP 2 {rid}")
        assert "tensor parallel: 2 ranks over gloo ready" in w.log()


def _rank_pids(worker_pid: int) -> list[int]:
    """The worker's spawned rank processes (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    return [int(pid) for pid in children
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_a_rank_killed_mid_stream_ends_the_worker(family, tmp_path):
    case, folder, _ = family
    if case != "llama":
        pytest.skip("one family is enough for the failure path")
    timeout_s = 5.0
    with worker(tmp_path, model__source=str(folder), model__name="tiny", engine__num_blocks="64",
                engine__tensor_parallel_size="2", engine__tensor_parallel_timeout_s=str(timeout_s),
                server__grace_period_s="3") as w, grpc.insecure_channel(w.address) as channel:
        stub = worker_pb2_grpc.GenerationStub(channel)
        assert len([t for r in _generate(stub, prompts()["short"], 8) for t in r.token_ids]) == 8
        (rank,) = _rank_pids(w.process.pid)
        # Frozen, so the next stream is in flight with rank 0 waiting in a collective; then gone.
        os.kill(rank, signal.SIGSTOP)
        stream = _generate(stub, prompts()["long"], 200)
        time.sleep(1.0)
        os.kill(rank, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as error:
            for _ in stream:
                pass
        assert time.monotonic() - killed < timeout_s + 2
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE, error.value
        assert "tp-rank-1" in error.value.details() or "collective" in error.value.details()
        deadline, status = time.monotonic() + 5, None
        while time.monotonic() < deadline:   # draining: NOT_SERVING, then refusing calls as it exits
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                status = "gone"
            if status in (health_pb2.HealthCheckResponse.NOT_SERVING, "gone"):
                break
            time.sleep(0.1)
        assert status in (health_pb2.HealthCheckResponse.NOT_SERVING, "gone"), status
        assert w.process.wait(timeout=30) != 0
        assert "tensor parallel group broken" in w.log()


def _refusal(model_cfg: ModelSourceConfig, **engine) -> str:
    with pytest.raises(ValueError) as e:
        start_tensor_parallel(model_cfg, EngineConfig(**engine))
    return str(e.value)


def test_a_size_that_does_not_divide_the_heads_is_refused(family):
    _, folder, _ = family
    message = _refusal(ModelSourceConfig(source=str(folder), device="cpu"), tensor_parallel_size=3)
    assert "tensor_parallel_size 3 does not divide the attention heads" in message and "(4)" in message


def test_a_size_beyond_the_devices_is_refused(family):
    _, folder, _ = family
    message = _refusal(ModelSourceConfig(source=str(folder), device="cpu"), tensor_parallel_size=2, devices="cpu")
    assert message == "engine.tensor_parallel_size 2 exceeds the devices: engine.devices lists 1 (cpu)"
    if torch.cuda.device_count() < 2:
        cuda = _refusal(ModelSourceConfig(source=str(folder), device="cuda"), tensor_parallel_size=2)
        assert "exceeds the devices: this machine has" in cuda
    assert "positive integer" in _refusal(ModelSourceConfig(source=str(folder)), tensor_parallel_size=0)

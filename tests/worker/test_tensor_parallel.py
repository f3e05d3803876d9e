"""Tensor parallelism on the CPU: two ranks over gloo (services/worker/parallel).

Tiny random Llama (o_proj bias; one KV head, so it is replicated on both ranks), Qwen3 (q/k
norms, two KV heads split), Phi-3 (fused qkv/gate_up tensors in the checkpoint) and Qwen3-MoE
(experts split, a dense layer beside) checkpoints, built by transformers
(tests/worker/families.py), give at tensor_parallel_size 2 the greedy tokens of
tensor_parallel_size 1 (and of transformers, up to its near-ties) under batching, chunked
prefill, prefix caching and preemption, and through a real gRPC worker; Gemma 3 and Mixtral too
under make test-soak. A rank killed mid-stream ends the stream with an error and the worker
exits; the router retries elsewhere (soak). Sizes that do not divide the heads or exceed the
devices, and options TP lacks, are refused at start.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.v1 import router_pb2, router_pb2_grpc, worker_pb2_grpc
from llmserve.v1 import worker_pb2 as pb
from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine
from services.worker.model.shapes import NAMED_SHAPES
from services.worker.parallel.driver import start_tensor_parallel
from services.worker.parallel.validate import check_shardable
from tests.procs import free_port, service, worker
from tests.router.real_workers import start_workers
from tests.worker.families import ENGINE_SETTINGS, NEW_TOKENS, assert_matches, build_family, prompts
from tests.worker.test_engine import greedy, run

CASES = {
    "llama": ("llama", dict(attention_bias=True, num_key_value_heads=1)),
    "qwen3": ("qwen3", dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Checkpoint tensors holding every segment (Phi-3's qkv_proj and gate_up_proj), and experts.
    "phi3": ("phi3", dict()),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    mlp_only_layers=[1], head_dim=32)),
    # make test-soak only: sandwich norms, sliding and global layers, soft-capped logits; MoE with a window.
    "gemma3_text": ("gemma3_text", dict(head_dim=16, sliding_window=10, num_hidden_layers=3,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                                        tie_word_embeddings=False)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=10)),
}
SOAK_ONLY = ["gemma3_text", "mixtral"]
EVERY_SETTING = ["llama", "qwen3"]    # the others: batched only (CI time)
# Chunked prefill and preemption in one engine (with batching and prefix-cache hits): CI runs it;
# each of the families' settings alone runs under make test-soak.
SETTINGS = {"mixed": dict(max_num_batched_tokens=8, num_blocks=7), **ENGINE_SETTINGS}


def _setting_cases():
    for case in CASES:
        for setting in SETTINGS:
            if case in SOAK_ONLY:
                if setting == "batched":
                    yield pytest.param(case, setting, marks=pytest.mark.slow)
            elif case not in EVERY_SETTING:
                if setting == "batched":
                    yield case, setting
            elif setting == "mixed":
                yield case, setting
            else:
                yield pytest.param(case, setting, marks=pytest.mark.slow)


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


@pytest.mark.parametrize("family, setting", list(_setting_cases()), indirect=["family"])
def test_two_ranks_give_the_tokens_of_one(family, setting):
    case, folder, references = family
    one, _ = engine_tokens(folder, 1, **SETTINGS[setting])
    two, facts = engine_tokens(folder, 2, **SETTINGS[setting])
    for rid, ref in references.items():
        assert_matches(two[rid], ref, f"{case} {setting} TP 2 {rid}")
        assert two[f"{rid}-again"] == two[rid], f"{case} {setting} {rid}: a prefix-cache hit changed it"
    assert two == one, f"{case} {setting}: TP 2 differs from TP 1"
    assert facts["cached"] >= 32 and facts["leaked"] == 0, facts
    if setting in ("preemption", "mixed"):
        assert facts["preemptions"] > 0


def _generate(stub, ids: list[int], max_tokens: int):
    return stub.Generate(pb.GenerateRequest(
        model="tiny", token_ids=pb.TokenIdsPrompt(ids=ids),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)), timeout=120)


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)], indirect=True)
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
    """The worker's spawned rank processes (not multiprocessing's resource tracker), children of
    its engine core process (or of the worker, with the engine in process)."""
    ranks, parents = [], [worker_pid]
    while parents:
        parent = parents.pop()
        for pid in map(int, Path(f"/proc/{parent}/task/{parent}/children").read_text().split()):
            (ranks if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes() else parents).append(pid)
    return ranks


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_a_rank_killed_mid_stream_ends_the_worker(family, tmp_path):
    _, folder, _ = family
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
        elapsed = time.monotonic() - killed
        assert elapsed < timeout_s, f"the stream ended {elapsed:.1f}s after the kill"
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE, error.value
        assert "tp-rank-1" in error.value.details() or "collective" in error.value.details()
        deadline, status = time.monotonic() + 5, None
        while time.monotonic() < deadline:   # draining: NOT_SERVING, then refusing calls as it exits
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), e   # shutting down
                status = "gone"
            if status in (health_pb2.HealthCheckResponse.NOT_SERVING, "gone"):
                break
            time.sleep(0.1)
        assert status in (health_pb2.HealthCheckResponse.NOT_SERVING, "gone"), status
        assert w.process.wait(timeout=30) != 0, w.log()[-3000:]
        assert "tensor parallel group broken" in w.log()


@pytest.mark.slow   # four processes and a router: over a minute on two cores
@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_the_router_fails_over_from_a_broken_tensor_parallel_worker(family, tmp_path):
    """A request waiting on a TP worker whose rank dies before its first token is retried by the
    router on the other worker, and the broken one leaves the pool."""
    _, folder, references = family
    with contextlib.ExitStack() as stack:
        doomed, spare = start_workers(stack, tmp_path, 2, model__source=str(folder), model__name="tiny",
                                      engine__num_blocks="64", engine__tensor_parallel_size="2",
                                      engine__tensor_parallel_timeout_s="5", server__grace_period_s="3")
        port = free_port()
        router = stack.enter_context(service("services.router", {
            "LLMSERVE_ROUTER__SERVER__PORT": str(port), "LLMSERVE_ROUTER__SERVER__METRICS_PORT": str(free_port()),
            "LLMSERVE_ROUTER__HEALTH__INTERVAL_S": "0.2",
            "LLMSERVE_ROUTER__MODELS__tiny__ADDRESSES": json.dumps([doomed.address, spare.address]),
        }, f"127.0.0.1:{port}", tmp_path))
        channel = stack.enter_context(grpc.insecure_channel(router.address))
        admin, stub = router_pb2_grpc.RouterStub(channel), worker_pb2_grpc.GenerationStub(channel)
        (rank,) = _rank_pids(doomed.process.pid)
        os.kill(rank, signal.SIGSTOP)      # the doomed worker's next step waits in a collective
        admin.SetDraining(router_pb2.SetDrainingRequest(address=spare.address, draining=True))
        stream = _generate(stub, prompts()["mid"], NEW_TOKENS)
        deadline = time.monotonic() + 30
        while _workers(admin)[doomed.address].in_flight < 1:
            assert time.monotonic() < deadline, "the request never reached the doomed worker"
            time.sleep(0.05)
        admin.SetDraining(router_pb2.SetDrainingRequest(address=spare.address, draining=False))
        os.kill(rank, signal.SIGKILL)
        replies = list(stream)
        assert replies[-1].worker == spare.address
        assert_matches([t for r in replies for t in r.token_ids], references["mid"], "retried on the spare")
        assert doomed.process.wait(timeout=30) != 0
        deadline = time.monotonic() + 10
        while _workers(admin)[doomed.address].healthy:
            assert time.monotonic() < deadline, "the router still counts the broken worker healthy"
            time.sleep(0.1)


def _workers(admin) -> dict:
    return {w.address: w for w in admin.ListWorkers(router_pb2.ListWorkersRequest(model="tiny")).workers}


def _refusal(model_cfg: ModelSourceConfig, **engine) -> str:
    with pytest.raises(ValueError) as e:
        start_tensor_parallel(model_cfg, EngineConfig(**engine))
    return str(e.value)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_a_size_that_does_not_divide_the_heads_is_refused(family):
    _, folder, _ = family
    message = _refusal(ModelSourceConfig(source=str(folder), device="cpu"), tensor_parallel_size=3)
    assert "tensor_parallel_size 3 does not divide the attention heads" in message and "(4)" in message


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_a_size_beyond_the_devices_is_refused(family):
    _, folder, _ = family
    message = _refusal(ModelSourceConfig(source=str(folder), device="cpu"), tensor_parallel_size=2, devices="cpu")
    assert message == "engine.tensor_parallel_size 2 exceeds the devices: engine.devices lists 1 (cpu)"
    if torch.cuda.device_count() < 2:
        cuda = _refusal(ModelSourceConfig(source=str(folder), device="cuda"), tensor_parallel_size=2)
        assert "exceeds the devices: this machine has" in cuda
    assert "positive integer" in _refusal(ModelSourceConfig(source=str(folder)), tensor_parallel_size=0)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_options_a_tensor_parallel_worker_lacks_are_refused(family):
    _, folder, _ = family
    int8 = ModelSourceConfig(source=str(folder), device="cpu", quantization="int8")
    assert "model.quantization 'int8' is not supported" in _refusal(int8, tensor_parallel_size=2)
    plain = ModelSourceConfig(source=str(folder), device="cpu")
    assert "draft_model is not supported" in _refusal(plain, tensor_parallel_size=2, speculative_method="draft_model")


def test_shapes_the_ranks_cannot_split_are_refused():
    tiny = NAMED_SHAPES["tiny"]
    with pytest.raises(ValueError, match="and the 3 KV heads of tiny: one must divide the other"):
        check_shardable(replace(tiny, num_heads=12, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="does not divide the vocabulary of tiny \\(1001\\)"):
        check_shardable(replace(tiny, vocab_size=1001), 2)
    with pytest.raises(ValueError, match="does not divide the MLP intermediate size of tiny \\(129\\)"):
        check_shardable(replace(tiny, intermediate_size=129), 2)
    check_shardable(replace(tiny, num_heads=8, num_kv_heads=2), 4)   # 2 KV heads, each on two ranks

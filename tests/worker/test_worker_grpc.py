"""The worker as a real process over real gRPC: streaming, cancellation, bad input, metrics."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest

from llmserve.v1 import worker_pb2 as pb
from llmserve.v1 import worker_pb2_grpc
from tests.procs import free_port, worker

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def running_worker(tmp_path_factory):
    metrics_port = free_port()
    with worker(tmp_path_factory.mktemp("worker"), metrics_port=metrics_port) as w:
        w.metrics_port = metrics_port
        yield w


@pytest.fixture
def stub(running_worker):
    with grpc.insecure_channel(running_worker.address) as channel:
        yield worker_pb2_grpc.GenerationStub(channel)


def chat(content: str, max_tokens: int = 16, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        model=MODEL, chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content=content)]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling))


def wait_idle(stub, timeout=5.0) -> pb.LoadReport:
    deadline = time.monotonic() + timeout
    while True:
        load = stub.GetLoad(pb.GetLoadRequest())
        if (load.kv_blocks_used == 0 and load.running == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def test_streams_a_chat_answer_with_usage(stub):
    responses = list(stub.Generate(chat("What is the capital of France?", 24), timeout=60))
    text = "".join(r.text for r in responses)
    assert "Paris" in text
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    usage = responses[-1].usage
    assert usage.prompt_tokens > 20 and usage.completion_tokens == sum(len(r.token_ids) for r in responses)
    assert all(not r.HasField("usage") for r in responses[:-1])
    assert responses[0].worker


def test_cancelled_stream_frees_its_blocks(stub):
    call = stub.Generate(chat("Write a long essay about the ocean.", 2000, ignore_eos=True), timeout=60)
    for i, _ in enumerate(call):
        if i == 2:
            break
    assert stub.GetLoad(pb.GetLoadRequest()).kv_blocks_used > 0
    call.cancel()
    load = wait_idle(stub)
    assert load.kv_blocks_used == 0 and load.running == 0


def test_n_choices_and_logprobs(stub):
    request = chat("Name a color.", 5, n=2, logprobs=True, top_logprobs=2, seed=1)
    request.sampling.temperature = 1.0
    responses = list(stub.Generate(request, timeout=60))
    assert {r.index for r in responses} == {0, 1}
    finished = [r for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert len(finished) == 2
    for r in responses:
        assert len(r.logprobs) == len(r.token_ids)
        for lp in r.logprobs:
            assert len(lp.top_logprobs) == 2 and lp.logprob <= 0


def test_models_tokenize_and_load(stub):
    models = stub.ListModels(pb.ListModelsRequest()).models
    assert [m.name for m in models] == [MODEL] and models[0].max_context_length > 0
    tok = stub.Tokenize(pb.TokenizeRequest(model=MODEL, text="hello world"))
    assert tok.count == len(tok.token_ids) == 2
    load = stub.GetLoad(pb.GetLoadRequest())
    assert load.model == MODEL and load.kv_blocks_total == 511


@pytest.mark.parametrize("request_, code", [
    (pb.GenerateRequest(model=MODEL), grpc.StatusCode.INVALID_ARGUMENT),                       # no prompt
    (pb.GenerateRequest(model=MODEL, text=""), grpc.StatusCode.INVALID_ARGUMENT),              # empty prompt
    (pb.GenerateRequest(model="no-such-model", text="hi"), grpc.StatusCode.NOT_FOUND),
    (pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIdsPrompt(ids=[5, 999999])), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(model=MODEL, text="hi", sampling=pb.SamplingParams(temperature=5)), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(model=MODEL, text="hi", sampling=pb.SamplingParams(top_logprobs=50, logprobs=True)),
     grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(model=MODEL, text="hi", sampling=pb.SamplingParams(max_tokens=10**7)), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(model=MODEL, chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="wizard", content="x")])),
     grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(model=MODEL, chat=pb.ChatPrompt()), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_bad_input_is_refused_and_the_engine_keeps_serving(stub, request_, code):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request_, timeout=30))
    assert e.value.code() == code and e.value.details()
    assert "Paris" in "".join(r.text for r in stub.Generate(chat("What is the capital of France?", 12), timeout=60))


def test_metrics_use_vllm_names(stub, running_worker):
    list(stub.Generate(chat("Hi", 4), timeout=60))
    body = urllib.request.urlopen(f"http://127.0.0.1:{running_worker.metrics_port}/metrics").read().decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count"):
        assert name in body, name

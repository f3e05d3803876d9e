"""The openai SDK through the gateway to a real worker process (SmolLM2 on CPU): text, usage,
finish reasons; and a client that goes away, before or after the first token, frees the worker's
KV blocks within a second."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import grpc
import openai
import pytest

from llmserve.v1 import worker_pb2, worker_pb2_grpc
from tests.gateway.harness import GatewayHarness, gateway_config
from tests.gateway.test_disconnect import read_until, send_request
from tests.procs import free_port, service

MODEL = "smollm2-135m-instruct"
IM_END = 2      # SmolLM2's <|im_end|>, its EOS


@pytest.fixture(scope="module")
def worker_address(tmp_path_factory) -> str:
    port = free_port()
    env = {"LLMSERVE_WORKER__SERVER__PORT": str(port), "LLMSERVE_WORKER__SERVER__METRICS_PORT": "0",
           "LLMSERVE_WORKER__ENGINE__NUM_BLOCKS": "256", "LLMSERVE_WORKER__ENGINE__MAX_MODEL_LEN": "1024",
           "LLMSERVE_WORKER__ENGINE__NUM_THREADS": "1",
           "LLMSERVE_WORKER__ENGINE__MAX_NUM_BATCHED_TOKENS": "64"}  # long prompts prefill over many steps
    with service("services.worker", env, f"127.0.0.1:{port}", tmp_path_factory.mktemp("worker"), timeout=180):
        yield f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def real(tmp_path_factory, worker_address, conversations_address):
    cfg = gateway_config(f"sqlite:///{Path(tmp_path_factory.mktemp('real')) / 'g.db'}", conversations_address)
    cfg.upstream.address = worker_address
    with GatewayHarness(cfg, fake_upstream=False) as harness:
        yield harness


@pytest.fixture(scope="module")
def key(real: GatewayHarness) -> str:
    return real.new_org("real")[2]


_channels: dict[str, grpc.Channel] = {}


def load(address: str) -> worker_pb2.LoadReport:
    channel = _channels.get(address) or _channels.setdefault(address, grpc.insecure_channel(address))
    return worker_pb2_grpc.GenerationStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


def assert_blocks_freed_within_a_second(address: str, closed_at: float) -> None:
    while True:
        report = load(address)
        if report.running == 0 and report.waiting == 0 and report.kv_blocks_used == 0:
            return
        assert time.monotonic() - closed_at < 1.0, f"still held a second after the client left: {report}"
        time.sleep(0.02)


USER = [{"role": "user", "content": "Name three colors."}]


def test_sdk_whole_and_streamed(real, key):
    sdk = openai.OpenAI(base_url=real.base_url + "/v1", api_key=key)
    reply = sdk.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=8, temperature=0)
    assert reply.choices[0].message.content and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 5
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=8, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content          # greedy: the same text either way
    assert chunks[-1].usage.completion_tokens == 8
    assert [m.id for m in sdk.models.list().data] == [MODEL]
    workers = real.admin("GET", "/admin/v1/workers")          # a worker is not a router
    assert workers.status_code == 501 and workers.json()["error"]["code"] == "not_implemented"


async def test_async_sdk_stop_finish(real, key):
    sdk = openai.AsyncOpenAI(base_url=real.base_url + "/v1", api_key=key)
    reply = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                              max_completion_tokens=200, temperature=0)
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens < 200
    await sdk.close()


def test_vllm_sampling_extensions_reach_the_engine(real, key):
    """extra_body as vLLM's clients send it: ignore_eos runs to max tokens where the answer would
    stop; min_tokens holds EOS off; a stop token id ends it even so; top_k 1 is greedy at any
    temperature; a token id outside the vocabulary is the worker's 400, naming it."""
    sdk = openai.OpenAI(base_url=real.base_url + "/v1", api_key=key)

    def ask(temperature=0.0, **extra):
        return sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           max_completion_tokens=120, temperature=temperature, seed=7,
                                           extra_body=extra)

    short = ask()
    answered = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and answered < 60
    held = ask(ignore_eos=True)
    assert held.choices[0].finish_reason == "length" and held.usage.completion_tokens == 120
    assert held.choices[0].message.content.startswith(short.choices[0].message.content)
    assert ask(min_tokens=answered + 5).usage.completion_tokens >= answered + 5
    stopped = ask(ignore_eos=True, stop_token_ids=[IM_END])        # the chat template's end of turn
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == answered
    assert ask(temperature=1.5, top_k=1).choices[0].message.content == short.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        ask(stop_token_ids=[10_000_000])


@pytest.mark.parametrize("when", ["before", "after"])
def test_disconnect_frees_worker_blocks(real, key, worker_address, when):
    long_prompt = "Write a very long story about the sea. " * (80 if when == "before" else 1)  # ~720 tokens
    sock = send_request(real, key, {"model": MODEL, "stream": True, "max_completion_tokens": 200,
                                    "messages": [{"role": "user", "content": long_prompt}]})
    if when == "after":
        read_until(sock, b'"content":"')
        assert load(worker_address).kv_blocks_used > 0
    else:  # the worker has the request (prefilling a long prompt) and nothing was streamed yet
        deadline = time.monotonic() + 30
        while load(worker_address).kv_blocks_used == 0:
            assert time.monotonic() < deadline, f"the request never reached the worker: {sock.recv(4096)!r}"
            time.sleep(0.005)
        sock.setblocking(False)
        try:
            assert b"data:" not in sock.recv(65536)
        except BlockingIOError:
            pass
    sock.shutdown(socket.SHUT_RDWR)
    closed_at = time.monotonic()
    sock.close()
    assert_blocks_freed_within_a_second(worker_address, closed_at)

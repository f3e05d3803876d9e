"""The router as a process in front of three real worker processes (SmolLM2 on the CPU).

Few and short on purpose: the workers start once for the module, prompts are small and
max_tokens low. Routing logic in depth is tested against fake workers (test_router_routing.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request

import grpc
import pytest

from llmserve.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.procs import free_port, service
from tests.router.real_workers import start_workers
from tests.router.router_fakes import read_rest

pytestmark = pytest.mark.real_workers

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a helpful assistant. Answer briefly and plainly, in one or two sentences."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three workers and a router process in front of them."""
    tmp = tmp_path_factory.mktemp("cluster")
    with contextlib.ExitStack() as stack:
        workers = start_workers(stack, tmp, 3)
        port, metrics_port = free_port(), free_port()
        router = stack.enter_context(service("services.router", {
            "LLMSERVE_ROUTER__SERVER__PORT": str(port),
            "LLMSERVE_ROUTER__SERVER__METRICS_PORT": str(metrics_port),
            "LLMSERVE_ROUTER__HEALTH__INTERVAL_S": "0.2",
            f"LLMSERVE_ROUTER__MODELS__{MODEL}__ADDRESSES": json.dumps([w.address for w in workers]),
        }, f"127.0.0.1:{port}", tmp))
        router.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield router, workers


class Client:
    def __init__(self, address: str):
        self.channel = grpc.aio.insecure_channel(address)
        self.generation = worker_pb2_grpc.GenerationStub(self.channel)
        self.admin = router_pb2_grpc.RouterStub(self.channel)

    async def workers(self) -> dict[str, router_pb2.WorkerStatus]:
        listed = await self.admin.ListWorkers(router_pb2.ListWorkersRequest(model=MODEL))
        return {w.address: w for w in listed.workers}

    async def drain_all_but(self, keep: str, draining: bool = True) -> None:
        for address in await self.workers():
            if address != keep:
                await self.admin.SetDraining(router_pb2.SetDrainingRequest(address=address, draining=draining))


def chat(messages: list[tuple[str, str]], max_tokens: int = 4, **sampling) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        model=MODEL, chat=worker_pb2.ChatPrompt(messages=[worker_pb2.ChatMessage(role=r, content=c)
                                                          for r, c in messages]),
        sampling=worker_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling))


async def load_of(address: str) -> worker_pb2.LoadReport:
    async with grpc.aio.insecure_channel(address) as channel:
        return await worker_pb2_grpc.GenerationStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)


async def test_unrelated_requests_spread_evenly(cluster):
    router, workers = cluster
    client = Client(router.address)
    questions = ["Name a red fruit.", "What is 2+2?", "Say hi.", "Name a planet.", "Pick a color.", "Count to 3."]
    replies = await asyncio.gather(*(_collect(client.generation.Generate(chat([("user", q)])))
                                     for q in questions))
    served = sorted(sum(r[-1].worker == w.address for r in replies) for w in workers)
    assert served == [2, 2, 2]
    await client.channel.close()


async def test_a_conversation_stays_on_the_worker_holding_its_prefix(cluster):
    router, workers = cluster
    client = Client(router.address)
    before = {w.address: await load_of(w.address) for w in workers}
    messages = [("system", SYSTEM), ("user", "What is the capital of France?")]
    served, cached = [], []
    for question in ("And of Italy?", "And of Spain?", "And of Portugal?"):
        replies = [r async for r in client.generation.Generate(chat(messages))]
        served.append(replies[-1].worker)
        cached.append(replies[-1].usage.cached_prompt_tokens)
        messages += [("assistant", "".join(r.text for r in replies)), ("user", question)]
    assert len(set(served)) == 1, served
    holder = served[0]
    assert all(c > 0 for c in cached[1:]), cached        # later turns reuse the earlier turns' blocks
    after = await load_of(holder)
    assert after.prefix_cache_hits - before[holder].prefix_cache_hits >= sum(cached)
    for other in (w.address for w in workers if w.address != holder):
        assert (await load_of(other)).prefix_cache_queries == before[other].prefix_cache_queries
    await client.channel.close()


async def test_a_killed_worker_ends_only_its_streams(cluster):   # last: it kills a worker
    router, workers = cluster
    doomed, bystander, _ = workers
    client = Client(router.address)
    long_answer = dict(max_tokens=24, ignore_eos=True)

    async def open_on(target, request) -> grpc.aio.UnaryStreamCall:
        await client.drain_all_but(target.address)
        call = client.generation.Generate(request, timeout=120)
        first = await call.read()
        assert first.worker == target.address
        await client.drain_all_but(target.address, draining=False)
        return call

    bystander_stream = await open_on(bystander, chat([("user", "Tell me a story.")], **long_answer))
    doomed_stream = await open_on(doomed, chat([("user", "Tell me a long story.")], **long_answer))
    # A request with a long prompt is still in prefill on the doomed worker when it is killed.
    await client.drain_all_but(doomed.address)
    no_token_yet = asyncio.create_task(_collect(client.generation.Generate(
        chat([("user", "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 60)]), timeout=120)))
    for _ in range(500):
        if (await client.workers())[doomed.address].in_flight == 2:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the long request never reached the doomed worker")
    await client.drain_all_but(doomed.address, draining=False)   # somewhere to retry
    doomed.kill()

    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await read_rest(doomed_stream)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "failed mid-stream" in failed.value.details() and doomed.address not in failed.value.details()
    retried = await no_token_yet
    assert retried[-1].worker != doomed.address and retried[-1].usage.prompt_tokens > 500
    rest = await read_rest(bystander_stream)
    assert rest[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
    for i in range(3):
        reply = await _collect(client.generation.Generate(chat([("user", f"Afterwards {i}")])))
        assert reply[-1].worker != doomed.address
    assert not (await client.workers())[doomed.address].healthy
    metrics = (await asyncio.to_thread(lambda: urllib.request.urlopen(router.metrics_url, timeout=5).read())).decode()
    labels = f'{{model="{MODEL}",worker="{doomed.address}"}}'
    assert f"llmserve_router_mid_stream_failures_total{labels} 1.0" in metrics
    assert f"llmserve_router_worker_healthy{labels} 0.0" in metrics
    await client.channel.close()


async def _collect(call) -> list[worker_pb2.GenerateResponse]:
    return [r async for r in call]

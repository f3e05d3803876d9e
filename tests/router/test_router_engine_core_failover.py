"""The router in front of two real workers when one worker's engine core process is SIGKILLed
(the front end lives on): the doomed worker's stream ends with UNAVAILABLE, a request that had
no token yet is retried on the other worker, later requests all go to the survivor, and the
router marks the doomed worker unhealthy (it reports NOT_SERVING, then exits)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from llmserve.v1 import worker_pb2
from tests.procs import service
from tests.router.router_fakes import read_rest
from tests.router.test_router_real_workers import MODEL, Client, _collect, chat
from tests.worker.core_procs import core_worker, engine_core_process, port_in_range

pytestmark = pytest.mark.real_workers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("core-cluster")
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(2) as pool:   # each takes tens of seconds: start them side by side
            workers = list(pool.map(lambda _: stack.enter_context(core_worker(tmp)), range(2)))
        port = port_in_range()
        router = stack.enter_context(service("services.router", {
            "LLMSERVE_ROUTER__SERVER__PORT": str(port),
            "LLMSERVE_ROUTER__SERVER__METRICS_PORT": "0",
            "LLMSERVE_ROUTER__HEALTH__INTERVAL_S": "0.2",
            f"LLMSERVE_ROUTER__MODELS__{MODEL}__ADDRESSES": json.dumps([w.address for w in workers]),
        }, f"127.0.0.1:{port}", tmp))
        yield router, workers


async def test_the_router_fails_over_when_a_workers_engine_core_dies(cluster):
    router, (doomed, survivor) = cluster
    client = Client(router.address)
    await client.drain_all_but(doomed.address)
    doomed_stream = client.generation.Generate(chat([("user", "Tell me a long story.")], max_tokens=200,
                                                    ignore_eos=True), timeout=120)
    first = await doomed_stream.read()
    assert first.worker == doomed.address
    # A long prompt is still in prefill on the doomed worker when its core dies: no token sent yet.
    no_token_yet = asyncio.create_task(_collect(client.generation.Generate(
        chat([("user", "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 60)]), timeout=120)))
    for _ in range(500):
        if (await client.workers())[doomed.address].in_flight == 2:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the long request never reached the doomed worker")
    await client.drain_all_but(doomed.address, draining=False)   # somewhere to retry
    engine_core_process(doomed).send_signal(signal.SIGKILL)

    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await read_rest(doomed_stream)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "failed mid-stream" in failed.value.details()
    retried = await no_token_yet
    assert retried[-1].worker == survivor.address and retried[-1].usage.prompt_tokens > 500
    for i in range(3):
        reply = await _collect(client.generation.Generate(chat([("user", f"Afterwards {i}")]), timeout=120))
        assert reply[-1].worker == survivor.address
        assert reply[-1].finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED
    for _ in range(300):   # the router's health checks see NOT_SERVING, then nothing
        if not (await client.workers())[doomed.address].healthy:
            break
        await asyncio.sleep(0.1)
    assert not (await client.workers())[doomed.address].healthy
    assert await asyncio.to_thread(doomed.process.wait, 60) != 0
    await client.channel.close()

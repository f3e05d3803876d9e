"""Routing through a real router to scripted fake workers over gRPC."""

import asyncio
import urllib.request
from collections import Counter

import grpc
import pytest
from prometheus_client import generate_latest
from tests.procs import free_port
from tests.router.router_fakes import eventually, read_rest, router_config

from llmserve.v1 import router_pb2, worker_pb2


def chat_request(messages: list[tuple[str, str]], model: str = "m") -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(model=model, chat=worker_pb2.ChatPrompt(
        messages=[worker_pb2.ChatMessage(role=r, content=c) for r, c in messages]))


def served_by(workers) -> Counter:
    return Counter({w.address: len(w.requests) for w in workers})


async def test_a_multi_turn_conversation_keeps_landing_on_one_worker(fake_workers, start_router):
    workers = await fake_workers(3)
    client = await start_router(router_config({"m": workers}))
    await client.generate(text="warm-up so that every worker is not equally empty")
    messages = [("system", "You are a terse assistant who answers in one line, citing no sources."),
                ("user", "Tell me about tides.")]
    for turn in range(6):
        replies = [r async for r in client.generation.Generate(chat_request(messages))]
        messages += [("assistant", "".join(r.text for r in replies)), ("user", f"And question {turn}?")]
    holders = [w for w in workers if any(r.HasField("chat") for r in w.requests)]
    assert len(holders) == 1 and sum(r.HasField("chat") for r in holders[0].requests) == 6
    metrics = generate_latest(client.router.metrics.registry).decode()
    assert f'llmserve_router_cache_affinity_hits_total{{model="m",worker="{holders[0].address}"}} 5.0' in metrics


async def test_a_burst_of_unrelated_requests_spreads_evenly(fake_workers, start_router):
    workers = await fake_workers(3)
    for w in workers:
        w.hold = "before_first"       # keep every stream open until the whole burst is dispatched
    client = await start_router(router_config({"m": workers}))
    burst = [asyncio.create_task(client.generate(text=f"question number {i}: something else entirely"))
             for i in range(30)]
    await eventually(lambda: sum(len(w.requests) for w in workers) == 30, what="the burst to arrive")
    assert sorted(served_by(workers).values()) == [10, 10, 10]
    assert [w.in_flight for w in client.router.registry.workers()] == [10, 10, 10]
    for w in workers:
        w.release()
    assert all(len(replies) == 3 for replies in await asyncio.gather(*burst))
    assert [w.in_flight for w in client.router.registry.workers()] == [0, 0, 0]


async def test_a_killed_worker_ends_only_its_streams_and_unstarted_requests_go_elsewhere(
        fake_workers, start_router):
    doomed, survivor = await fake_workers(2)
    client = await start_router(router_config({"m": [doomed, survivor]}))
    survivor_stream = await _open_on(client, survivor, doomed, "after_first", "survivor's own stream")
    survivor.hold = None
    doomed_stream = await _open_on(client, doomed, survivor, "after_first", "streamed before the kill")
    doomed.hold = "before_first"
    await client.admin.SetDraining(router_pb2.SetDrainingRequest(address=survivor.address, draining=True))
    not_started = asyncio.create_task(client.generate(text="no token yet when the worker dies"))
    await eventually(lambda: len(doomed.requests) == 2, what="the unstarted request to reach the doomed worker")
    await client.admin.SetDraining(router_pb2.SetDrainingRequest(address=survivor.address, draining=False))

    await doomed.kill()

    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await read_rest(doomed_stream)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "failed mid-stream" in failed.value.details() and doomed.address not in failed.value.details()
    retried = await not_started
    assert retried[-1].worker == survivor.address and len(retried) == 3
    survivor.release()
    assert [r.worker for r in await read_rest(survivor_stream)] == [survivor.address] * 2
    assert (await client.generate(text="after the kill"))[0].worker == survivor.address
    [status] = [w for w in (await client.admin.ListWorkers(router_pb2.ListWorkersRequest())).workers
                if w.address == doomed.address]
    assert not status.healthy
    metrics = generate_latest(client.router.metrics.registry).decode()
    assert f'llmserve_router_retries_total{{model="m",worker="{doomed.address}"}} 1.0' in metrics
    assert f'llmserve_router_worker_healthy{{model="m",worker="{doomed.address}"}} 0.0' in metrics


async def _open_on(client, target, other, hold, text):
    """Opens a stream that lands on `target` (the other worker drained meanwhile) and has
    received its first message; returns the call for reading the rest."""
    target.hold = hold
    await client.admin.SetDraining(router_pb2.SetDrainingRequest(address=other.address, draining=True))
    call = client.generation.Generate(worker_pb2.GenerateRequest(model="m", text=text), timeout=10)
    first = await call.read()
    assert first.worker == target.address
    await client.admin.SetDraining(router_pb2.SetDrainingRequest(address=other.address, draining=False))
    return call


async def test_draining_takes_no_new_requests_and_finishes_running_ones(fake_workers, start_router):
    workers = await fake_workers(2)
    drained, other = workers
    client = await start_router(router_config({"m": workers}, policy="round_robin"))
    running = await _open_on(client, drained, other, "after_first", "running while drained")
    status = await client.admin.SetDraining(router_pb2.SetDrainingRequest(address=drained.address, draining=True))
    assert status.draining and status.healthy and status.in_flight == 1
    for i in range(4):
        assert (await client.generate(text=f"new {i}"))[0].worker == other.address
    drained.release()
    assert len(await read_rest(running)) == 2
    await client.admin.SetDraining(router_pb2.SetDrainingRequest(address=drained.address, draining=False))
    assert {(await client.generate(text=f"back {i}"))[0].worker for i in range(2)} == {d.address for d in workers}

    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await client.admin.SetDraining(router_pb2.SetDrainingRequest(address="10.9.9.9:1", draining=True))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_unknown_model_is_not_found(fake_workers, start_router):
    client = await start_router(router_config({"m": await fake_workers(1)}))
    for call in (client.generate(model="nope"),
                 client.generation.Tokenize(worker_pb2.TokenizeRequest(model="nope", text="x")),
                 client.admin.ListWorkers(router_pb2.ListWorkersRequest(model="nope"))):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nope" in e.value.details()


async def test_two_model_pools_side_by_side(fake_workers, start_router):
    pool_a = await fake_workers(2, model="a")
    pool_b = await fake_workers(1, model="b")
    client = await start_router(router_config({"a": pool_a, "b": pool_b}))
    for i in range(4):
        assert (await client.generate(model="a", text=f"for a {i}"))[0].worker in {w.address for w in pool_a}
        assert (await client.generate(model="b", text=f"for b {i}"))[0].worker == pool_b[0].address
    assert all(r.model == "a" for w in pool_a for r in w.requests)
    models = await client.generation.ListModels(worker_pb2.ListModelsRequest())
    assert sorted((m.name, m.max_context_length) for m in models.models) == [("a", 2048), ("b", 2048)]
    listed = await client.admin.ListWorkers(router_pb2.ListWorkersRequest(model="b"))
    assert [(w.address, w.model, w.healthy, w.source) for w in listed.workers] == \
        [(pool_b[0].address, "b", True, "static")]


async def test_cancellation_reaches_the_worker(fake_workers, start_router):
    [worker] = await fake_workers(1)
    worker.hold = "after_first"
    client = await start_router(router_config({"m": [worker]}))
    call = client.generation.Generate(worker_pb2.GenerateRequest(model="m", text="cancel me"), timeout=10)
    await call.read()
    call.cancel()
    await eventually(lambda: worker.cancelled == 1, what="the worker call to be cancelled")
    await eventually(lambda: client.router.registry.find(worker.address).in_flight == 0, what="in_flight release")


async def test_trace_context_passes_through(fake_workers, start_router):
    [worker] = await fake_workers(1)
    client = await start_router(router_config({"m": [worker]}))
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    request = worker_pb2.GenerateRequest(model="m", text="traced")
    [_ async for _ in client.generation.Generate(
        request, metadata=(("traceparent", traceparent), ("x-private", "secret")), timeout=10)]
    assert worker.metadata[0]["traceparent"] == traceparent
    assert "x-private" not in worker.metadata[0]


@pytest.mark.parametrize("request_kw, message", [
    ({"model": ""}, "model is required"),
    ({"model": "a", "text": None}, "prompt is required"),
    ({"model": "a", "text": None, "chat": worker_pb2.ChatPrompt()}, "no messages"),
])
async def test_bad_input_is_invalid_argument(fake_workers, start_router, request_kw, message):
    pools = {"a": await fake_workers(1, model="a"), "b": await fake_workers(1, model="b")}
    client = await start_router(router_config(pools))
    kw = {"text": "hello", **request_kw}
    request = worker_pb2.GenerateRequest(**{k: v for k, v in kw.items() if v is not None})
    with pytest.raises(grpc.aio.AioRpcError) as e:
        [_ async for _ in client.generation.Generate(request, timeout=10)]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
    assert not any(w.requests for ws in pools.values() for w in ws)


async def test_the_workers_own_errors_pass_through_without_retry(fake_workers, start_router):
    workers = await fake_workers(2)
    for w in workers:
        w.fail_with = grpc.StatusCode.INVALID_ARGUMENT
    client = await start_router(router_config({"m": workers}))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.generate(text="bad sampling, say")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == "scripted failure"
    assert sum(len(w.requests) for w in workers) == 1
    assert all(w.healthy for w in client.router.registry.workers())


async def test_an_empty_model_means_the_only_pool(fake_workers, start_router):
    [worker] = await fake_workers(1)
    client = await start_router(router_config({"m": [worker]}))
    assert (await client.generate(model=""))[0].worker == worker.address
    assert worker.requests[0].model == "m"


async def test_unhealthy_workers_leave_the_pool_and_rejoin(fake_workers, start_router):
    sick, well = await fake_workers(2)
    client = await start_router(router_config({"m": [sick, well]}, policy="round_robin"))
    await sick.set_serving(False)
    await eventually(lambda: not client.router.registry.find(sick.address).healthy, what="the check to fail")
    assert {(await client.generate(text=f"r{i}"))[0].worker for i in range(4)} == {well.address}
    await sick.set_serving(True)
    await eventually(lambda: client.router.registry.find(sick.address).healthy, what="the worker to rejoin")
    assert {(await client.generate(text=f"s{i}"))[0].worker for i in range(4)} == {sick.address, well.address}


async def test_affinity_survives_a_missed_check_but_not_a_restart(fake_workers, start_router):
    workers = await fake_workers(3)
    for w in workers:
        w.load.prefix_cache_queries = 1000
    client = await start_router(router_config({"m": workers}))
    conversation = "a conversation that has gone on for a good many turns already. " * 4
    [holder] = {(await client.generate(text=conversation))[0].worker for _ in range(2)}
    sick = next(w for w in workers if w.address == holder)
    known = client.router.registry.find(holder)
    await sick.set_serving(False)                 # busy or briefly unreachable: its cache is intact
    await eventually(lambda: not known.healthy, what="the check to fail")
    await sick.set_serving(True)
    await eventually(lambda: known.healthy, what="the worker to rejoin")
    pool = client.router.registry.pool("m")
    assert pool.prefixes.size(holder) > 0
    assert (await client.generate(text=conversation + " and one more"))[0].worker == holder
    sick.load.prefix_cache_queries = 0            # it restarted: an empty cache
    await eventually(lambda: pool.prefixes.size(holder) == 0, what="the memory to be forgotten")


async def test_no_healthy_worker_is_unavailable(fake_workers, start_router):
    [worker] = await fake_workers(1)
    client = await start_router(router_config({"m": [worker]}))
    await worker.kill()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.generate(text="anyone?")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no healthy worker for model m" in e.value.details()


async def test_a_worker_serving_another_model_is_kept_out(fake_workers, start_router):
    [wrong] = await fake_workers(1, model="other")
    config = router_config({"m": [wrong]})
    client = await start_router(config)
    await asyncio.sleep(3 * config.health.interval_s)
    assert not client.router.registry.find(wrong.address).healthy


async def test_workers_register_and_deregister(fake_workers, start_router):
    [worker] = await fake_workers(1, model="late")
    client = await start_router(router_config({"m": []}))
    status = await client.admin.RegisterWorker(router_pb2.RegisterWorkerRequest(address=worker.address, model="late"))
    assert status.healthy and status.source == "registered"
    assert (await client.generate(model="late"))[0].worker == worker.address
    await client.admin.DeregisterWorker(router_pb2.DeregisterWorkerRequest(address=worker.address))
    assert not (await client.admin.ListWorkers(router_pb2.ListWorkersRequest(model="late"))).workers
    for bad in (router_pb2.RegisterWorkerRequest(address="no-port", model="late"),
                router_pb2.RegisterWorkerRequest(address=worker.address, model="")):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.admin.RegisterWorker(bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_tokenize_and_aggregate_load(fake_workers, start_router):
    workers = await fake_workers(2)
    workers[0].load.running, workers[1].load.running = 2, 3
    workers[0].load.kv_blocks_total = workers[1].load.kv_blocks_total = 100
    client = await start_router(router_config({"m": workers}))
    reply = await client.generation.Tokenize(worker_pb2.TokenizeRequest(model="m", text="ab cde"))
    assert list(reply.token_ids) == [2, 3]
    load = await client.generation.GetLoad(worker_pb2.GetLoadRequest())
    assert (load.model, load.running, load.kv_blocks_total) == ("m", 5, 200)


async def test_metrics_are_served_over_http(fake_workers, start_router):
    workers = await fake_workers(2)
    config = router_config({"m": workers})
    config.server.metrics_port = free_port()
    client = await start_router(config)
    await client.generate(text="counted")
    url = f"http://127.0.0.1:{config.server.metrics_port}/metrics"
    page = (await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())).decode()
    for worker in workers:
        assert f'llmserve_router_worker_healthy{{model="m",worker="{worker.address}"}} 1.0' in page
    assert 'llmserve_router_requests_total{decision="cache_miss",model="m"' in page


async def test_requests_sharing_an_affinity_key_land_together_whatever_their_prompts(fake_workers, start_router):
    workers = await fake_workers(3)
    client = await start_router(router_config({"m": workers}))
    for i in range(6):   # unrelated prompts, one key (an OpenAI prompt_cache_key)
        request = worker_pb2.GenerateRequest(model="m", text=f"prompt {i} shares nothing {i * 7919}",
                                             affinity_key="user-42")
        assert len([r async for r in client.generation.Generate(request)]) == 3
    assert sorted(served_by(workers).values()) == [0, 0, 6]
    for i in range(6):   # without a key the same prompts spread
        await client.generate(text=f"prompt {i} shares nothing {i * 7919}")
    assert max(served_by(workers).values()) < 12

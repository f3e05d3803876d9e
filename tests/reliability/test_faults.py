"""Faults of real processes: a worker SIGKILLed mid-stream behind the router, the router killed
and restarted under the gateway, no routable worker, a gateway killed during streams of a stored
conversation. Every error message a client sees (gRPC details, SSE error events, HTTP error
bodies) names no internal address. Each test leaves the platform whole again."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import grpc
import httpx
import pytest

from llmserve.v1 import worker_pb2, worker_pb2_grpc
from tests.reliability.clients import (Admin, assert_no_address, chat_body, chat_request, load, set_draining,
                                       sse_events, wait_idle, wait_routable)
from tests.reliability.platform import MODEL

LONG = 96   # tokens: the doomed streams are still running when their worker dies


class SseStream:
    """One streamed chat completion through the gateway, read in two parts."""

    def __init__(self, session: aiohttp.ClientSession, url: str, body: dict):
        self.session, self.url, self.body = session, url, body
        self.response: aiohttp.ClientResponse | None = None
        self.text = ""

    async def first_token(self) -> None:
        self.response = await self.session.post(self.url, json=self.body)
        assert self.response.status == 200, await self.response.text()
        async for line in self.response.content:
            self.text += line.decode()
            if '"content"' in line.decode():
                return
        raise AssertionError(f"the stream ended before any content: {self.text}")

    async def rest(self) -> list:
        async for line in self.response.content:
            self.text += line.decode()
        self.response.release()
        return sse_events(self.text)


async def first_message(call) -> worker_pb2.GenerateResponse:
    return await call.read()


async def rest_of(call) -> list[worker_pb2.GenerateResponse]:
    """The remaining messages, read with read() (a call read once cannot switch to iteration)."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


@contextlib.contextmanager
def restored(proc):
    """Starts `proc` again after the test if the test left it dead (so later tests find it whole)."""
    try:
        yield proc
    finally:
        if not proc.alive():
            proc.start().wait_ready()


async def test_a_killed_worker_fails_only_its_streams_and_rejoins(platform):
    with restored(platform.workers[0]):
        await killed_worker_scenario(platform)


@pytest.mark.slow
async def test_a_worker_killed_again_and_again_rejoins_every_time(platform):
    with restored(platform.workers[0]):
        for _ in range(4):
            await killed_worker_scenario(platform)


async def killed_worker_scenario(platform):
    w0, w1 = platform.workers
    router = platform.router.address
    secret = Admin(platform.gateway_url).new_org("faults-kill")[2]
    url = platform.gateway_url + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {secret}"}
    async with grpc.aio.insecure_channel(router) as channel, \
            aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=180)) as session:
        stub = worker_pb2_grpc.GenerationStub(channel)

        async def pinned_to(worker, other, n):
            """Two streams that land on `worker` (the other drained meanwhile): gRPC through the
            router and SSE through the gateway, each past its first token."""
            set_draining(router, other.address, True)
            try:
                call = stub.Generate(chat_request(f"Tell story number {n}.", LONG, ignore_eos=True), timeout=180)
                assert (await first_message(call)).worker == worker.address
                sse = SseStream(session, url, chat_body(f"Tell story number {n}.", LONG, stream=True,
                                                        ignore_eos=True))
                await sse.first_token()
            finally:
                set_draining(router, other.address, False)
            return call, sse

        safe_call, safe_sse = await pinned_to(w1, w0, 2)
        doomed_call, doomed_sse = await pinned_to(w0, w1, 1)
        w0.kill()   # at once: the doomed streams have just started

        try:
            await asyncio.wait_for(rest_of(doomed_call), 60)
            raise AssertionError("the stream of the killed worker ended normally")
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            assert "failed mid-stream" in e.details()
            assert_no_address(e.details())
        events = await asyncio.wait_for(doomed_sse.rest(), 60)
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "upstream_unavailable", events[-3:]
        assert_no_address(errors[0]["error"]["message"])
        assert events[-1] == "[DONE]"

        finished = await asyncio.wait_for(rest_of(safe_call), 120)
        assert finished[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
        safe_events = await asyncio.wait_for(safe_sse.rest(), 120)
        assert not [e for e in safe_events if isinstance(e, dict) and "error" in e]
        assert [e for e in safe_events if isinstance(e, dict)][-1]["choices"][0]["finish_reason"] == "length"

        for i in range(3):   # new requests go to the survivor
            async with session.post(url, json=chat_body(f"After the crash {i}", 2)) as r:
                assert r.status == 200, await r.text()

    w0.start().wait_ready()
    wait_routable(router, w0.address)
    before = load(w0.address).prefix_cache_queries
    set_draining(router, w1.address, True)
    try:
        with httpx.Client(timeout=120, headers=headers) as http:
            r = http.post(url, json=chat_body("Back again?", 2))
        assert r.status_code == 200, r.text
    finally:
        set_draining(router, w1.address, False)
    assert load(w0.address).prefix_cache_queries > before   # the restarted worker served it
    for w in platform.workers:
        wait_idle(w.address)


async def test_router_restart_under_the_gateway(platform):
    with restored(platform.router):
        await router_restart_scenario(platform)


async def router_restart_scenario(platform):
    secret = Admin(platform.gateway_url).new_org("faults-router")[2]
    url = platform.gateway_url + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {secret}"}
    async with grpc.aio.insecure_channel(platform.router.address) as channel, \
            aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=120)) as session:
        stub = worker_pb2_grpc.GenerationStub(channel)
        assert (await rest_of(stub.Generate(chat_request("Before", 2), timeout=60)))[-1].usage.completion_tokens == 2

        in_flight = SseStream(session, url, chat_body("Tell a long story.", LONG, stream=True))
        await in_flight.first_token()
        platform.router.kill()
        events = await asyncio.wait_for(in_flight.rest(), 30)   # ends with an error, does not hang
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert errors, events[-3:]
        assert_no_address(errors[0]["error"]["message"])

        async with session.post(url, json=chat_body("While it is down", 2)) as r:   # refused, not hung
            assert r.status in (502, 503), await r.text()
            assert (await r.json())["error"]["code"]
            assert_no_address((await r.json())["error"]["message"])

        platform.router.start().wait_ready()
        wait_routable(platform.router.address, platform.workers[0].address)
        wait_routable(platform.router.address, platform.workers[1].address)
        started, status = time.monotonic(), None
        while time.monotonic() - started < 60:   # the gateway's channel reconnects by itself
            async with session.post(url, json=chat_body("After the restart", 2)) as r:
                status = r.status
                if status == 200:
                    break
            await asyncio.sleep(0.5)
        assert status == 200, f"the gateway never reached the restarted router (last status {status})"
        # A gRPC client's channel opened before the restart reconnects as well.
        replies = await rest_of(stub.Generate(chat_request("After", 2), timeout=60, wait_for_ready=True))
        assert replies[-1].usage.completion_tokens == 2
    for w in platform.workers:
        wait_idle(w.address)


async def test_no_routable_worker_is_a_clear_503_without_addresses(platform):
    router = platform.router.address
    secret = Admin(platform.gateway_url).new_org("faults-drained")[2]
    for w in platform.workers:
        set_draining(router, w.address, True)
    try:
        async with grpc.aio.insecure_channel(router) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await rest_of(worker_pb2_grpc.GenerationStub(channel).Generate(chat_request("Anyone?", 2), timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == f"no healthy worker for model {MODEL}"
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {secret}"}) as http:
            for body in (chat_body("Anyone?", 2), chat_body("Anyone?", 2, stream=True)):
                r = http.post(platform.gateway_url + "/v1/chat/completions", json=body)
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert r.json()["error"]["code"] == "upstream_unavailable"
                assert_no_address(r.json()["error"]["message"])
    finally:
        for w in platform.workers:
            set_draining(router, w.address, False)


async def test_a_gateway_killed_during_streams_keeps_stored_conversations(platform):
    gateway = platform.gateways[0]
    with restored(gateway):
        secret = Admin(gateway.address).new_org("faults-gateway")[2]
        headers = {"Authorization": f"Bearer {secret}"}
        with httpx.Client(base_url=gateway.address, timeout=120, headers=headers) as http:
            cid = http.post("/v1/conversations", json={"title": "kept"}).json()["id"]
            for turn in ("Name a bird.", "Name a tree."):
                r = http.post("/v1/chat/completions", json={**chat_body(turn, 3), "conversation_id": cid})
                assert r.status_code == 200, r.text
            before = http.get(f"/v1/conversations/{cid}").json()
        assert before["message_count"] == 4

        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as session:
            streams = [SseStream(session, gateway.address + "/v1/chat/completions",
                                 {**chat_body(f"Tell a long story {i}.", LONG, stream=True), "conversation_id": cid})
                       for i in range(2)]
            for s in streams:
                await s.first_token()
            gateway.kill()
            for s in streams:   # the clients see the connection end, not a hang
                try:
                    await asyncio.wait_for(s.rest(), 30)
                except aiohttp.ClientError:
                    pass
        gateway.start().wait_ready()
        with httpx.Client(base_url=gateway.address, timeout=60, headers=headers) as http:
            after = http.get(f"/v1/conversations/{cid}").json()
        assert after["messages"][:4] == before["messages"]        # the stored turns are intact
        assert after["message_count"] in (4, 6, 8)                 # interrupted turns: stored whole or not at all
    for w in platform.workers:
        wait_idle(w.address)

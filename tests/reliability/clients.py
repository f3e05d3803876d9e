"""Small clients of the platform used across the suite: gRPC Generation/Router calls and the
gateway's admin and chat APIs over HTTP."""

from __future__ import annotations

import json
import re
import time

import grpc
import httpx

from llmserve.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.reliability.platform import ADMIN_TOKEN, MODEL


def chat_request(content: str, max_tokens: int = 8, **sampling) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        model=MODEL, chat=worker_pb2.ChatPrompt(messages=[worker_pb2.ChatMessage(role="user", content=content)]),
        sampling=worker_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling))


def load(address: str) -> worker_pb2.LoadReport:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.GenerationStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


def wait_idle(address: str, timeout: float = 15) -> worker_pb2.LoadReport:
    """Polls a worker until nothing runs or waits and every KV block is back; fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        report = load(address)
        if report.running == 0 and report.waiting == 0 and report.kv_blocks_used == 0:
            return report
        assert time.monotonic() < deadline, f"{address} not idle after {timeout}s: {report}"
        time.sleep(0.05)


def router_workers(router: str) -> dict[str, router_pb2.WorkerStatus]:
    with grpc.insecure_channel(router) as channel:
        reply = router_pb2_grpc.RouterStub(channel).ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
    return {w.address: w for w in reply.workers}


def set_draining(router: str, address: str, draining: bool) -> None:
    with grpc.insecure_channel(router) as channel:
        router_pb2_grpc.RouterStub(channel).SetDraining(
            router_pb2.SetDrainingRequest(address=address, draining=draining), timeout=5)


def wait_routable(router: str, address: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        w = router_workers(router).get(address)
        if w is not None and w.healthy and not w.draining:
            return
        assert time.monotonic() < deadline, f"router never saw {address} healthy again: {w}"
        time.sleep(0.1)


class Admin:
    """The gateway's admin API with the admin token."""

    def __init__(self, base_url: str):
        self.http = httpx.Client(base_url=base_url, timeout=30, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})

    def new_org(self, name: str, rpm: int = 0, tpm: int = 0) -> tuple[str, str, str]:
        """(org id, key id, secret) of a fresh organization with one key."""
        org = self.http.post("/admin/v1/organizations", json={"name": name, "rpm_limit": rpm, "tpm_limit": tpm})
        assert org.status_code == 201, org.text
        key = self.http.post(f"/admin/v1/organizations/{org.json()['id']}/keys", json={"name": f"{name}-key"})
        assert key.status_code == 201, key.text
        return org.json()["id"], key.json()["id"], key.json()["key"]

    def revoke(self, key_id: str) -> httpx.Response:
        return self.http.delete(f"/admin/v1/keys/{key_id}")


def api(base_url: str, secret: str, timeout: float = 60) -> httpx.Client:
    return httpx.Client(base_url=base_url, timeout=timeout, headers={"Authorization": f"Bearer {secret}"})


def chat_body(content: str, max_tokens: int = 4, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_completion_tokens": max_tokens,
            "temperature": 0, **extra}


def sse_events(text: str) -> list[dict | str]:
    """The data events of an SSE body: parsed JSON objects, and the "[DONE]" marker as a string."""
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ipv4:/ipv6:/unix: targets, dotted quads, localhost, host:port
_ADDRESS = re.compile(r"ipv[46]:|unix:|\b\d{1,3}(?:\.\d{1,3}){3}\b|\blocalhost\b|[\w.-]+:\d{2,5}\b")


def assert_no_address(message: str) -> None:
    """A client-visible error message names no internal address (those belong in the logs)."""
    assert message, "an empty error message"
    assert not _ADDRESS.search(message), f"an internal address in a client-visible message: {message!r}"

"""The gateway's own cost: added latency per request and streamed chunks per second through the
gateway, against calling an instantly answering worker directly, in one run.

    python -m bench.gateway [--requests 300] [--stream-tokens 20000] [--json out.json]

Three processes: an instant fake worker (gRPC Generation), the real gateway (`python -m
services.gateway`, pinned to one core when the machine has more than one) and this client.
Targets (issue 4): under 2 ms added at p50, at least 5,000 streamed chunks/s on one core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc

from bench.timing import percentile
from llmserve.v1 import worker_pb2, worker_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
MODEL = "instant"
KEY = "sk-bench"


class InstantWorker(worker_pb2_grpc.GenerationServicer):
    """Answers max_tokens one-token messages with no compute at all."""

    async def ListModels(self, request, context):
        return worker_pb2.ListModelsResponse(models=[worker_pb2.ModelInfo(name=MODEL, max_context_length=1 << 20)])

    async def Generate(self, request, context):
        n = request.sampling.max_tokens or 1
        for i in range(n):
            last = i == n - 1
            reply = worker_pb2.GenerateResponse(request_id=request.request_id, token_ids=[i], text="x",
                                                finish_reason=worker_pb2.FINISH_REASON_LENGTH if last else 0)
            if last:
                reply.usage.prompt_tokens, reply.usage.completion_tokens = 5, n
            yield reply


async def serve_worker(port: int) -> None:
    server = grpc.aio.server()
    worker_pb2_grpc.add_GenerationServicer_to_server(InstantWorker(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, *args], cwd=REPO, env={**os.environ, **env}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


async def direct_latency(stub, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        async for _ in stub.Generate(worker_pb2.GenerateRequest(
                model=MODEL, chat=worker_pb2.ChatPrompt(messages=[worker_pb2.ChatMessage(role="user", content="hi")]),
                sampling=worker_pb2.SamplingParams(max_tokens=1))):
            pass
        times.append(time.perf_counter() - started)
    return times


async def gateway_latency(http: aiohttp.ClientSession, url: str, count: int) -> list[float]:
    times = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1}
    for _ in range(count):
        started = time.perf_counter()
        async with http.post(url, json=body) as reply:
            assert reply.status == 200, await reply.text()
            await reply.read()
        times.append(time.perf_counter() - started)
    return times


async def direct_stream(stub, tokens: int) -> float:
    started, chunks = time.perf_counter(), 0
    async for _ in stub.Generate(worker_pb2.GenerateRequest(
            model=MODEL, chat=worker_pb2.ChatPrompt(messages=[worker_pb2.ChatMessage(role="user", content="hi")]),
            sampling=worker_pb2.SamplingParams(max_tokens=tokens))):
        chunks += 1
    return chunks / (time.perf_counter() - started)


async def gateway_stream(http: aiohttp.ClientSession, url: str, tokens: int) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": tokens,
            "stream": True}
    started, chunks = time.perf_counter(), 0
    async with http.post(url, json=body) as reply:
        assert reply.status == 200, await reply.text()
        async for line in reply.content:
            if line.startswith(b"data: {"):
                chunks += 1
    return chunks / (time.perf_counter() - started)


async def measure(args: argparse.Namespace, worker: str, gateway: str) -> dict:
    url = gateway + "/v1/chat/completions"
    async with grpc.aio.insecure_channel(worker) as channel, aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {KEY}"}) as http:
        stub = worker_pb2_grpc.GenerationStub(channel)
        await direct_latency(stub, 20)                      # warm both paths
        await gateway_latency(http, url, 20)
        direct, through = [], []
        for _ in range(3):                                  # interleaved rounds: both see the same machine load
            direct += await direct_latency(stub, args.requests // 3)
            through += await gateway_latency(http, url, args.requests // 3)
        direct_rate = await direct_stream(stub, args.stream_tokens)
        gateway_rate = await gateway_stream(http, url, args.stream_tokens)
    p50_direct, p50_gateway = statistics.median(direct), statistics.median(through)
    return {
        "requests": len(through), "stream_tokens": args.stream_tokens, "gateway_pinned_to_one_core": args.pinned,
        "latency_ms": {"direct_p50": p50_direct * 1e3, "gateway_p50": p50_gateway * 1e3,
                       "direct_p99": percentile(direct, 99) * 1e3, "gateway_p99": percentile(through, 99) * 1e3,
                       "added_p50": (p50_gateway - p50_direct) * 1e3},
        "stream_chunks_per_s": {"direct": direct_rate, "gateway": gateway_rate,
                                "gateway_over_direct": gateway_rate / direct_rate},
        "targets": {"added_p50_under_2ms": (p50_gateway - p50_direct) * 1e3 < 2.0,
                    "stream_at_least_5000_chunks_per_s": gateway_rate >= 5000},
    }


async def wait_http(url: str, process: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the gateway exited:\n{log.read_text()}")
            try:
                async with http.get(url) as reply:
                    if reply.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the gateway did not start:\n{log.read_text()}")
            await asyncio.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--stream-tokens", type=int, default=20_000)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--serve-worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_worker:
        asyncio.run(serve_worker(args.serve_worker))
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    worker_port, gateway_port = free_port(), free_port()
    worker = spawn(["-m", "bench.gateway", "--serve-worker", str(worker_port)], {}, tmp / "worker.log")
    gateway = spawn(["-m", "services.gateway"], {
        "LLMSERVE_GATEWAY__SERVER__PORT": str(gateway_port), "LLMSERVE_GATEWAY__SERVER__PLAIN_HTTP": "true",
        "LLMSERVE_GATEWAY__UPSTREAM__ADDRESS": f"127.0.0.1:{worker_port}",
        "LLMSERVE_GATEWAY__DATABASE__URL": f"sqlite:///{tmp / 'gateway.db'}",
        "LLMSERVE_GATEWAY__LOCAL_MODE__ENABLED": "true", "LLMSERVE_DEV_API_KEY": KEY}, tmp / "gateway.log")
    cores = sorted(os.sched_getaffinity(0))
    args.pinned = len(cores) > 1
    if args.pinned:   # the gateway gets one core; the worker and this client share the others
        os.sched_setaffinity(gateway.pid, {cores[0]})
        os.sched_setaffinity(worker.pid, set(cores[1:]))
        os.sched_setaffinity(0, set(cores[1:]))
    try:
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        asyncio.run(wait_http(gateway_url + "/healthz", gateway, tmp / "gateway.log"))
        results = asyncio.run(measure(args, f"127.0.0.1:{worker_port}", gateway_url))
    finally:
        for process in (gateway, worker):
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

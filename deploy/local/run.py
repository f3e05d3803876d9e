"""Run the whole platform on this machine (`make run`): python deploy/local/run.py.

Starts each service as its own process on loopback, with the embedded defaults:

    conversations  127.0.0.1:50060  SQLite in ./var/conversations.db
    worker         127.0.0.1:50051  smollm2-135m-instruct        (SmolLM2-135M, every core, dtype auto:
                                                                  bfloat16 on a CPU with bfloat16 units,
                                                                  else float32)
    worker-int8    127.0.0.1:50052  smollm2-135m-instruct-int8   (the same weights in int8, one thread)
    router         127.0.0.1:50050  one pool per model
    gateway        http://127.0.0.1:8080  local mode: a dev organization and API key, chat page at /

waits until each answers its health check, prints the addresses, and on Ctrl-C or SIGTERM stops
them all: SIGTERM to every process group, SIGKILL to what is left after the grace period.

Two variables switch from the embedded stores to shared servers:
    LLMSERVE_DATABASE_URL=postgresql://user@host:5432/db   conversations and the gateway use Postgres
    LLMSERVE_REDIS_URL=redis://host:6379/0                  the gateway's rate limiter uses Redis
Every other LLMSERVE_<SERVICE>__SECTION__KEY variable still overrides that service's settings.
The SQLite files live in ./var/ (--var-dir), the generated config files and each service's log in
./var/local/ (--run-dir). --port-offset N shifts every port by N, so a second platform (the
end-to-end tests, say) runs beside a developer's own; --port-base N instead numbers them N, N+1, ...
(DEFAULT_PORTS' order), so a whole platform fits a small range of ports.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "libs")]   # run as a script: import the services' configs

from llmserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from services.conversations import config as conversations_config  # noqa: E402
from services.gateway import config as gateway_config  # noqa: E402
from services.router import config as router_config  # noqa: E402
from services.worker import config as worker_config  # noqa: E402

HOST = "127.0.0.1"
# (name, model, dtype, quantization, torch threads (0: every core), port, metrics port). An idle
# worker takes no CPU, so the default model gets every core, in bfloat16 where the CPU multiplies
# it natively (1.8-2.3x float32's tokens/s on a Zen 4 burst, docs/perf/engine.md), else float32; the
# second pool, there to show several pools, is the int8 variant, fast on one thread.
WORKER_MODELS = (("worker", "smollm2-135m-instruct", "auto", "none", 0, 50051, 9151),
                 ("worker-int8", "smollm2-135m-instruct-int8", "float32", "int8", 1, 50052, 9152))
# Every port the platform listens on, in the order --port-base numbers them.
DEFAULT_PORTS = (50060, 9160, 50051, 9151, 50052, 9152, 50050, 9150, 8080)


@dataclass
class Service:
    name: str
    module: str                       # python -m <module> --config <file>
    config: Any                       # the service's typed config dataclass, written as YAML
    address: str                      # what the summary prints
    health: str                       # "grpc://host:port" (grpc.health.v1) or an HTTP URL
    metrics: str                      # Prometheus endpoint
    ports: tuple[int, ...]            # checked free before starting
    note: str = ""
    process: subprocess.Popen | None = field(default=None, repr=False)


def grpc_service(name: str, module: str, config: Any, port: int, metrics_port: int, note: str) -> Service:
    return Service(name, module, config, f"{HOST}:{port}", f"grpc://{HOST}:{port}",
                   f"http://{HOST}:{metrics_port}/metrics", (port, metrics_port), note)


def plan(environ: dict[str, str], port_offset: int = 0, var_dir: Path = REPO / "var",
         port_base: int | None = None) -> list[Service]:
    """The services in start order, each with its config; the two URL variables pick the stores,
    which otherwise are SQLite files in var_dir; every port is shifted by port_offset, or, with
    port_base, numbered from it in DEFAULT_PORTS' order."""
    database_url = environ.get("LLMSERVE_DATABASE_URL", "")
    redis_url = environ.get("LLMSERVE_REDIS_URL", "")

    def shift(*ports: int) -> list[int]:
        if port_base is not None:
            return [port_base + DEFAULT_PORTS.index(p) for p in ports]
        return [p + port_offset for p in ports]

    var_dir = Path(var_dir).resolve()

    conversations = conversations_config.ConversationsConfig()
    port, metrics_port = shift(50060, 9160)
    conversations.server = conversations_config.ServerConfig(host=HOST, port=port, metrics_port=metrics_port)
    conversations.store.url = database_url or f"sqlite:///{var_dir / 'conversations.db'}"
    services = [grpc_service("conversations", "services.conversations", conversations, port, metrics_port,
                             f"store {_redacted(conversations.store.url)}")]
    conversations_address = services[0].address

    pools = {}
    for name, model, dtype, quantization, threads, *ports in WORKER_MODELS:
        port, metrics_port = shift(*ports)
        worker = worker_config.WorkerConfig()
        worker.server = worker_config.ServerConfig(host=HOST, port=port, metrics_port=metrics_port, name=name)
        worker.model.name, worker.model.dtype, worker.model.quantization = model, dtype, quantization
        worker.engine.num_threads = threads or (os.cpu_count() or 2)
        # A float32 pool (int8 weights; the default model on a CPU without bfloat16 products) keeps
        # its KV cache in bfloat16: decode reads half the bytes (the int8 pool's burst 1.12x,
        # python -m bench.kv_cache_ab) and the pool holds twice the tokens. A bfloat16 model's is so already.
        worker.engine.kv_cache_dtype = "bfloat16"
        weights = f"dtype {dtype}" if quantization == "none" else quantization
        services.append(grpc_service(name, "services.worker", worker, port, metrics_port, f"{model} ({weights})"))
        pools[model] = router_config.PoolConfig(addresses=[f"{HOST}:{port}"])

    router = router_config.RouterConfig(models=pools)
    router.health.interval_s = 0.5    # fresher load reports for the gateway's admission
    port, metrics_port = shift(50050, 9150)
    router.server = router_config.ServerConfig(host=HOST, port=port, metrics_port=metrics_port)
    services.append(grpc_service("router", "services.router", router, port, metrics_port,
                                 f"pools: {', '.join(pools)}"))

    gateway = gateway_config.GatewayConfig()
    [port] = shift(8080)
    gateway.server.host, gateway.server.port, gateway.server.plain_http = HOST, port, True
    gateway.upstream.address = services[-1].address
    gateway.conversations.address = conversations_address
    gateway.local_mode.enabled = True
    gateway.database.url = database_url or f"sqlite:///{var_dir / 'gateway.db'}"
    # Admission follows what the workers report (docs/perf/load.md): first tokens within 1.7x what
    # the pool does idle (a CPU's unloaded TTFT p95 was 0.47 s on one 2-core VM and over 1 s on
    # another, so the product card's 1 s was 2.1x the one and unreachable on the other; 1 s until
    # the pool measured it), and a speed target that fits a CPU, 2 tokens/s per stream (so it
    # batches a burst: at 5 tokens/s 32 chats took 47 s, at 2 tokens/s 23 s); a burst of 64 waits up
    # to 30 s.
    overload = gateway.overload
    overload.ttft_target_s, overload.ttft_target_over_unloaded, overload.stream_tokens_per_s = 1.0, 1.7, 2.0
    overload.max_in_flight_per_worker, overload.max_in_flight_per_model = 8, 64
    overload.max_queued_per_model, overload.queue_timeout_s, overload.workers_poll_s = 64, 30.0, 0.5
    if redis_url:
        gateway.rate_limit.backend, gateway.rate_limit.redis_url = "redis", redis_url
    url = f"http://{HOST}:{port}"
    services.append(Service("gateway", "services.gateway", gateway, url, f"{url}/healthz", f"{url}/metrics",
                            (port,), f"rate limits in {'Redis' if redis_url else 'process memory'}"))
    return services


def start(service: Service, run_dir: Path) -> None:
    config_file = run_dir / f"{service.name}.yaml"
    config_file.write_text(yaml.safe_dump(dataclasses.asdict(service.config), sort_keys=False))
    log = open(run_dir / f"{service.name}.log", "ab")
    # Its own session and process group: the terminal's Ctrl-C reaches only the launcher, which
    # then stops every group in order, children of the services included.
    service.process = subprocess.Popen(
        [sys.executable, "-m", service.module, "--config", str(config_file)], cwd=REPO,
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()


def healthy(service: Service) -> bool:
    try:
        if service.health.startswith("grpc://"):
            # A fresh channel per probe: one that failed before the server listened backs off for seconds.
            with grpc.insecure_channel(service.health.removeprefix("grpc://")) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                return reply.status == health_pb2.HealthCheckResponse.SERVING
        with urllib.request.urlopen(service.health, timeout=2) as response:
            return response.status == 200
    except (grpc.RpcError, OSError):
        return False


def ready(service: Service) -> bool:
    """Healthy; a router also routes every model (its health checks have seen a worker of each),
    so the first chat after "ready" does not race the router's first round of checks."""
    if not healthy(service):
        return False
    if service.module != "services.router":
        return True
    try:
        with grpc.insecure_channel(service.address) as channel:
            reply = worker_pb2_grpc.GenerationStub(channel).ListModels(worker_pb2.ListModelsRequest(), timeout=2)
    except grpc.RpcError:
        return False
    return all(m.max_context_length for m in reply.models)


def wait_healthy(services: list[Service], stop: threading.Event, timeout_s: float, run_dir: Path) -> bool:
    deadline = time.monotonic() + timeout_s
    waiting = list(services)
    while waiting and not stop.is_set():
        for service in list(waiting):
            if service.process.poll() is not None:
                print(f"{service.name} exited with code {service.process.returncode} while starting:",
                      file=sys.stderr)
                print(_tail(run_dir / f"{service.name}.log"), file=sys.stderr)
                return False
            if ready(service):
                print(f"  {service.name:<14} ready", flush=True)
                waiting.remove(service)
        if time.monotonic() > deadline:
            print(f"not healthy after {timeout_s:.0f}s: {', '.join(s.name for s in waiting)} "
                  f"(logs in {run_dir})", file=sys.stderr)
            return False
        stop.wait(0.25)
    return not waiting


def stop_all(services: list[Service], grace_s: float) -> None:
    running = [s for s in reversed(services) if s.process is not None and s.process.poll() is None]
    for service in running:   # the gateway first, so no new request reaches a stopping service
        _signal_group(service.process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for service in running:
        try:
            service.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"  {service.name} did not stop within {grace_s:.0f}s: SIGKILL", file=sys.stderr)
    for service in running:
        _signal_group(service.process, signal.SIGKILL)   # also whatever a service left behind
        service.process.wait()


def summary(services: list[Service]) -> str:
    api_key = os.environ.get("LLMSERVE_DEV_API_KEY", gateway_config.LocalModeConfig().api_key)
    model = WORKER_MODELS[0][1]
    gateway = services[-1].address
    lines = ["", "llmserve is running:"]
    lines += [f"  {s.name:<14} {s.address:<24} {s.note}" for s in services]
    lines += ["", f"Chat page:  {gateway}/   (API key {api_key})",
              "Metrics:    " + "  ".join(s.metrics for s in services),
              "", "Try it:",
              f"  curl {gateway}/v1/chat/completions -H 'Authorization: Bearer {api_key}' \\",
              "    -H 'Content-Type: application/json' \\",
              f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
              "", "Ctrl-C stops everything."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--var-dir", default=str(REPO / "var"), help="the SQLite databases")
    parser.add_argument("--run-dir", help="config files and logs (default: VAR_DIR/local)")
    parser.add_argument("--port-offset", type=int, default=0, help="added to every port")
    parser.add_argument("--port-base", type=int, help=f"number the {len(DEFAULT_PORTS)} ports from this one instead")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for health")
    parser.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
    args = parser.parse_args(argv)

    services = plan(dict(os.environ), args.port_offset, Path(args.var_dir), args.port_base)
    busy = [(s.name, p) for s in services for p in s.ports if not _port_free(p)]
    if busy:
        print("ports in use (is llmserve already running?): "
              + ", ".join(f"{p} ({name})" for name, p in busy), file=sys.stderr)
        return 1
    run_dir = Path(args.run_dir or Path(args.var_dir) / "local")
    run_dir.mkdir(parents=True, exist_ok=True)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        print(f"starting {len(services)} services (logs in {run_dir}):", flush=True)
        for service in services:
            start(service, run_dir)
        if not wait_healthy(services, stop, args.startup_timeout, run_dir):
            return 0 if stop.is_set() else 1
        print(summary(services), flush=True)
        while not stop.wait(0.5):
            exited = [s for s in services if s.process.poll() is not None]
            if exited:
                for service in exited:
                    print(f"{service.name} exited with code {service.process.returncode}:\n"
                          f"{_tail(run_dir / f'{service.name}.log')}", file=sys.stderr)
                return 1
        return 0
    finally:
        print("stopping...", flush=True)
        stop_all(services, args.grace)
        print("stopped.", flush=True)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)   # start_new_session made the pid its group id
    except ProcessLookupError:
        pass


def _port_free(port: int) -> bool:
    """Nothing listens on it. SO_REUSEADDR as the servers bind: a port in TIME-WAIT after the last
    platform stopped is free to them."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
            return True
        except OSError:
            return False


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _redacted(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if at and ":" in credentials:
        return f"{scheme}{sep}{credentials.split(':')[0]}:***@{host}"
    return url


if __name__ == "__main__":
    sys.exit(main())

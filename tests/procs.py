"""Real service processes for tests: start on free ports, wait until healthy, stop for sure."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    name: str
    address: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=30)


def wait_grpc_healthy(address: str, timeout: float, process: subprocess.Popen | None = None,
                      log_path: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"process exited with {process.returncode}:\n{log_path.read_text() if log_path else ''}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not healthy after {timeout}s:\n{log_path.read_text() if log_path else ''}")


@contextmanager
def service(module: str, env: dict[str, str], address: str, tmp_path: Path, timeout: float = 180,
            name: str | None = None) -> Iterator[Service]:
    """Run `python -m module` with env overrides; yields once its gRPC health is SERVING."""
    name = name or module.rsplit(".", 1)[-1]
    log_path = tmp_path / f"{name}-{address.replace(':', '_')}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", module], cwd=REPO, env=full_env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    svc = Service(name, address, process, log_path)
    try:
        wait_grpc_healthy(address, timeout, process, log_path)
        yield svc
    finally:
        stop_process_group(process)


def stop_process_group(process: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM the process's group (it must have been started in a new session), then SIGKILL."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def worker_env(port: int, metrics_port: int = 0, **overrides: str) -> dict[str, str]:
    """Environment for a small CPU worker: SmolLM2, a modest KV cache, one torch thread."""
    env = {
        "LLMSERVE_WORKER__SERVER__PORT": str(port),
        "LLMSERVE_WORKER__SERVER__METRICS_PORT": str(metrics_port),
        "LLMSERVE_WORKER__ENGINE__NUM_BLOCKS": "512",
        "LLMSERVE_WORKER__ENGINE__NUM_THREADS": "1",
    }
    env.update({f"LLMSERVE_WORKER__{k.upper()}": v for k, v in overrides.items()})
    return env


@contextmanager
def worker(tmp_path: Path, metrics_port: int = 0, **overrides: str) -> Iterator[Service]:
    """A real worker process: `with worker(tmp_path, model__name="m") as w: w.address`."""
    port = free_port()
    with service("services.worker", worker_env(port, metrics_port, **overrides), f"127.0.0.1:{port}",
                 tmp_path) as svc:
        yield svc

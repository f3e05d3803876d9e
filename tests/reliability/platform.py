"""The whole platform as real processes on loopback, each restartable on its own port.

    conversations (SQLite) <- gateway x2 (one SQLite DB) -> router -> worker x2

Unlike tests/procs.service (a context manager per process), a Proc can be SIGKILLed and started
again on the same address mid-test, which the fault tests need. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tests.procs import REPO, free_port, wait_grpc_healthy, worker_env

MODEL = "smollm2-135m-instruct"
ADMIN_TOKEN = "adm-reliability-7f3c9a1e5b"
WORKER_SETTINGS = {"engine__num_blocks": "128", "engine__max_model_len": "1024"}
AUTH_CACHE_TTL_S = 1.0      # short, so revocation on the other replica is seen within the test
MAX_BODY_BYTES = 256 * 1024


@dataclass
class Proc:
    """One service process: `python -m module` with env overrides, health-checked by gRPC or HTTP."""
    name: str
    module: str
    env: dict[str, str]
    address: str                     # host:port of its gRPC server, or base URL of an HTTP one
    log_path: Path
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self) -> "Proc":
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module], cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 240) -> "Proc":
        if self.address.startswith("http"):
            wait_http_ok(self.address + "/healthz", timeout, self)
        else:
            wait_grpc_healthy(self.address, timeout, self.process, self.log_path)
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def restart(self, timeout: float = 240) -> "Proc":
        self.kill()
        return self.start().wait_ready(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict[str, int]:
        """VmRSS (kB), threads and open file descriptors, from /proc."""
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{self.pid}/status").read_text().splitlines())
        return {"rss_kb": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"]),
                "fds": len(os.listdir(f"/proc/{self.pid}/fd"))}


def wait_http_ok(url: str, timeout: float, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.process.returncode}:\n{proc.log()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout}s" + (f":\n{proc.log()[-3000:]}" if proc else ""))


def grpc_proc(name: str, module: str, env: dict[str, str], port: int, tmp: Path) -> Proc:
    return Proc(name, module, env, f"127.0.0.1:{port}", tmp / f"{name}.log")


def worker_proc(name: str, tmp: Path, **overrides: str) -> Proc:
    port = free_port()
    return grpc_proc(name, "services.worker", worker_env(port, **{**WORKER_SETTINGS, **overrides}), port, tmp)


def router_proc(tmp: Path, workers: list[Proc], **overrides: str) -> Proc:
    port = free_port()
    env = {"LLMSERVE_ROUTER__SERVER__PORT": str(port), "LLMSERVE_ROUTER__SERVER__METRICS_PORT": "0",
           "LLMSERVE_ROUTER__HEALTH__INTERVAL_S": "0.2",
           f"LLMSERVE_ROUTER__MODELS__{MODEL}__ADDRESSES": json.dumps([w.address for w in workers])}
    env.update({f"LLMSERVE_ROUTER__{k.upper()}": v for k, v in overrides.items()})
    return grpc_proc("router", "services.router", env, port, tmp)


def conversations_proc(tmp: Path) -> Proc:
    port = free_port()
    env = {"LLMSERVE_CONVERSATIONS__SERVER__PORT": str(port), "LLMSERVE_CONVERSATIONS__SERVER__METRICS_PORT": "0",
           "LLMSERVE_CONVERSATIONS__STORE__URL": f"sqlite:///{tmp / 'conversations.db'}"}
    return grpc_proc("conversations", "services.conversations", env, port, tmp)


def gateway_proc(name: str, tmp: Path, upstream: str, conversations: str, database_url: str,
                 **overrides: str) -> Proc:
    port = free_port()
    env = {"LLMSERVE_GATEWAY__SERVER__PORT": str(port), "LLMSERVE_GATEWAY__SERVER__PLAIN_HTTP": "true",
           "LLMSERVE_GATEWAY__SERVER__MAX_BODY_BYTES": str(MAX_BODY_BYTES),
           "LLMSERVE_GATEWAY__UPSTREAM__ADDRESS": upstream,
           "LLMSERVE_GATEWAY__UPSTREAM__KEEPALIVE_INTERVAL_S": "0.5",
           "LLMSERVE_GATEWAY__CONVERSATIONS__ADDRESS": conversations,
           "LLMSERVE_GATEWAY__DATABASE__URL": database_url,
           "LLMSERVE_GATEWAY__AUTH__ADMIN_TOKEN": ADMIN_TOKEN,
           "LLMSERVE_GATEWAY__AUTH__CACHE_TTL_S": str(AUTH_CACHE_TTL_S)}
    env.update({f"LLMSERVE_GATEWAY__{k.upper()}": v for k, v in overrides.items()})
    return Proc(name, "services.gateway", env, f"http://127.0.0.1:{port}", tmp / f"{name}.log")


def start_all(procs: list[Proc], timeout: float = 300) -> None:
    """Starts the processes together (model loading dominates) and waits for every one."""
    if not procs:
        return
    for p in procs:
        p.start()
    with ThreadPoolExecutor(len(procs)) as pool:
        list(pool.map(lambda p: p.wait_ready(timeout), procs))


@dataclass
class Platform:
    tmp: Path
    workers: list[Proc]
    router: Proc
    conversations: Proc
    gateways: list[Proc]
    database_path: Path

    @property
    def procs(self) -> list[Proc]:
        return [*self.gateways, self.router, *self.workers, self.conversations]

    @property
    def gateway_url(self) -> str:
        return self.gateways[0].address

    def logs(self) -> str:
        return "\n".join(p.log() for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def launch(tmp: Path, num_workers: int = 2, num_gateways: int = 2, **gateway_overrides: str) -> Platform:
    """Workers, router, conversations and gateways on free ports; stop() ends them all.
    gateway_overrides: LLMSERVE_GATEWAY__ settings, e.g. overload__max_in_flight_per_model="8"."""
    workers = [worker_proc(f"worker{i}", tmp) for i in range(num_workers)]
    router = router_proc(tmp, workers)
    conversations = conversations_proc(tmp)
    database = tmp / "gateway.db"
    gateways = [gateway_proc(f"gateway{i}", tmp, router.address, conversations.address, f"sqlite:///{database}",
                             **gateway_overrides) for i in range(num_gateways)]
    platform = Platform(tmp, workers, router, conversations, gateways, database)
    try:
        start_all([*workers, conversations])
        start_all([router])
        start_all(gateways[:1])      # one replica runs the DB migrations first
        start_all(gateways[1:])
    except BaseException:
        platform.stop()
        raise
    return platform

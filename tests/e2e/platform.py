"""The whole platform as `make run` starts it (deploy/local/run.py), on shifted ports and with its
own var/ directory, so it runs beside a developer's own platform and leaves nothing behind."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Iterator

import grpc
import httpx
import openai

from llmserve.v1 import worker_pb2, worker_pb2_grpc
from services.gateway.config import LocalModeConfig
from tests.browser import CHROMIUM_UNSAFE_PORTS

RUN_PY = Path(__file__).resolve().parents[2] / "deploy" / "local" / "run.py"
READY_LINE = "llmserve is running:"       # run.py prints it once every service is healthy
PR_SET_PDEATHSIG = 1


def load_launcher() -> ModuleType:
    spec = importlib.util.spec_from_file_location("llmserve_local_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


LAUNCHER = load_launcher()
MODELS = [model for _, model, *_ in LAUNCHER.WORKER_MODELS]


@dataclass
class Platform:
    gateway: str                       # http://127.0.0.1:PORT
    api_key: str                       # the local-mode development key
    admin_token: str
    workers: dict[str, str]            # model -> the worker's gRPC address
    addresses: dict[str, str]          # service name -> the address the launcher announces
    run_dir: Path                      # each service's config and log
    launcher_output: Path              # what a developer sees in the terminal

    def openai(self, api_key: str = "", **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway}/v1", api_key=api_key or self.api_key, **options)

    def async_openai(self, **options) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.gateway}/v1", api_key=self.api_key, **options)

    def http(self, token: str = "") -> httpx.Client:
        """Plain HTTP with a bearer token (the dev key unless told otherwise)."""
        return httpx.Client(base_url=self.gateway, timeout=60,
                            headers={"Authorization": f"Bearer {token or self.api_key}"})

    def load(self, model: str) -> worker_pb2.LoadReport:
        """The worker's own view of its load, straight over gRPC."""
        with grpc.insecure_channel(self.workers[model]) as channel:
            return worker_pb2_grpc.GenerationStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{_tail(p)}" for p in sorted(self.run_dir.glob("*.log")))


def _choose_port_offset(var_dir: Path) -> int:
    """An offset at which every port of the platform is free (checked again by the launcher) and
    none is one Chromium refuses to visit (offset 2000 put the gateway on 10080)."""
    for _ in range(50):
        offset = random.randrange(10, 150) * 100
        ports = [p for s in LAUNCHER.plan({}, offset, var_dir) for p in s.ports]
        if not CHROMIUM_UNSAFE_PORTS.intersection(ports) and all(map(LAUNCHER._port_free, ports)):
            return offset
    raise RuntimeError("no port offset with all of the platform's ports free")


def _die_with_parent() -> None:
    """In the launcher's child: SIGTERM when the test process dies, so it stops every service even
    if pytest itself is killed."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@contextmanager
def running_platform(var_dir: Path, startup_timeout_s: float = 420.0) -> Iterator[Platform]:
    offset = _choose_port_offset(var_dir)
    services = {s.name: s for s in LAUNCHER.plan({}, offset, var_dir)}
    run_dir = var_dir / "local"
    output = var_dir / "launcher.out"
    # The launcher's own defaults, not a developer's settings: no LLMSERVE_* variable leaks in.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_")} | {"PYTHONUNBUFFERED": "1"}
    with open(output, "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, str(RUN_PY), "--var-dir", str(var_dir), "--port-offset", str(offset),
             "--startup-timeout", str(startup_timeout_s)],
            cwd=RUN_PY.parents[2], env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent)
    local = LocalModeConfig()
    platform = Platform(services["gateway"].address, local.api_key, local.admin_token,
                        {s.config.model.name: s.address for s in services.values() if s.module == "services.worker"},
                        {name: s.address for name, s in services.items()}, run_dir, output)
    try:
        _wait_ready(launcher, platform, startup_timeout_s + 30)
        yield platform
    finally:
        _stop(launcher, run_dir)


def _wait_ready(launcher: subprocess.Popen, platform: Platform, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    output = platform.launcher_output
    while READY_LINE not in output.read_text(errors="replace"):
        if launcher.poll() is not None or time.monotonic() > deadline:
            state = f"exited with {launcher.returncode}" if launcher.poll() is not None else "timed out"
            raise RuntimeError(f"the platform did not start ({state}):\n{output.read_text(errors='replace')}\n"
                               f"{platform.logs()}")
        time.sleep(0.5)


def _stop(launcher: subprocess.Popen, run_dir: Path) -> None:
    """The launcher's own Ctrl-C path first; then SIGKILL to whatever still runs a config of run_dir."""
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGINT)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    for pid in _processes_using(run_dir):
        for kill in (os.killpg, os.kill):   # a service leads its own process group
            with suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)


def _processes_using(run_dir: Path) -> list[int]:
    """Service processes started with a config file from run_dir (a unique temporary directory)."""
    marker = str(run_dir).encode()
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            pass
    return pids


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

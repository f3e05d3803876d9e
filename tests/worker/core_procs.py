"""Real workers whose engine core runs in its own process (the default), on ports 47100-47199,
and the engine core process of a worker (its front end's one child)."""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from pathlib import Path
from typing import Iterator

import psutil

from tests.procs import Service, service, worker_env

_PORTS = itertools.cycle(range(47100, 47200))
_PORTS_LOCK = threading.Lock()


def port_in_range() -> int:
    """The next port of 47100-47199 that is free now."""
    with _PORTS_LOCK:
        for _ in range(100):
            port = next(_PORTS)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free port in 47100-47199")


@contextlib.contextmanager
def core_worker(tmp_path: Path, **overrides: str) -> Iterator[Service]:
    """A real worker (`python -m services.worker`, SmolLM2 on the CPU) on a port of this range."""
    port = port_in_range()
    with service("services.worker", worker_env(port, **overrides), f"127.0.0.1:{port}", tmp_path) as svc:
        yield svc


def engine_core_process(worker: Service) -> psutil.Process:
    """The worker's engine core: the front end's only child process."""
    children = psutil.Process(worker.process.pid).children()
    assert len(children) == 1, f"expected one engine core child, found {children}"
    return children[0]

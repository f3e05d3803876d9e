"""Several real worker processes started side by side (each takes tens of seconds on a busy CPU)."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.procs import Service, worker


def start_workers(stack: contextlib.ExitStack, tmp_path: Path, n: int, **overrides: str) -> list[Service]:
    """Starts n workers at once; each is stopped when `stack` closes, also when another failed to start."""
    contexts = [worker(tmp_path, **overrides) for _ in range(n)]

    def enter(context):
        service = context.__enter__()
        stack.push(context.__exit__)   # list.append-like: safe from the pool's threads
        return service

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(enter, contexts))

"""What the GPU benchmark scripts share: choosing the device (or the Triton interpreter for
--smoke on a CPU), timing without launch overhead, and writing markdown reports.

These scripts run on a GPU image that has python, torch and triton only: import nothing else.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch

# Packages of the service that the GPU image lacks; importing any of them here is a bug.
NOT_ON_GPU_IMAGE = ("grpc", "google.protobuf", "aiohttp", "redis", "asyncpg", "yaml",
                    "gguf", "prometheus_client", "opentelemetry", "pytest")


def parse_args(description: str, argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes; on a machine without CUDA, runs the Triton interpreter")
    return parser.parse_args(argv)


def select_device(smoke: bool) -> torch.device:
    """CUDA when present; else the CPU under the Triton interpreter, for --smoke only. Call before
    importing any Triton kernel module: the interpreter is chosen at import time."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not smoke:
        sys.exit("this benchmark needs a CUDA GPU (--smoke runs tiny shapes on the CPU)")
    os.environ["TRITON_INTERPRET"] = "1"
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU (Triton interpreter, smoke shapes: timings mean nothing)"


def seconds_per_call(calls: list[Callable[[], object]], device: torch.device,
                     graph: bool = True) -> float:
    """Mean seconds per call of `calls` run in turn, after one warm-up round (which compiles).

    On CUDA the round is captured once as a CUDA graph and replayed, so host launch overhead is
    not counted (as in an engine that replays graphs); graph=False times eager launches, for code
    that copies from the host. Timed with CUDA events over >= ~20 ms of replays."""
    for call in calls:
        call()
    if device.type != "cuda":
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) / len(calls)
    torch.cuda.synchronize()
    run_round = lambda: [call() for call in calls]  # noqa: E731
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            run_round()
        run_round = cuda_graph.replay  # noqa: E731
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 1
    while True:
        start.record()
        for _ in range(reps):
            run_round()
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end) / 1e3
        if elapsed >= 0.02 or reps >= 1000:
            return elapsed / (reps * len(calls))
        reps = min(1000, max(2 * reps, int(reps * 0.025 / max(elapsed, 1e-6))))


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second moved (read + write) by a device-to-device copy of nbytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds_per_call([lambda: dst.copy_(src)], device)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def report(filename: str, markdown: str) -> None:
    """Prints the report and writes it to $OUT/filename when OUT is set."""
    print(markdown, flush=True)
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, filename), "w") as f:
            f.write(markdown + "\n")


def check_imports() -> None:
    """Fails if anything the GPU image lacks was imported along the way."""
    present = [name for name in NOT_ON_GPU_IMAGE if name in sys.modules]
    if present:
        sys.exit(f"imported packages the GPU image does not have: {', '.join(present)}")

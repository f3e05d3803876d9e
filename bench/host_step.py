"""Host time per engine step at a large decode batch (make bench-engine, section 6).

A tiny random model (random:tiny: 2 layers, hidden 64) makes the forward pass nearly free, so
what a step costs is the engine's Python: scheduling, preparing the runner's inputs and
processing the outputs. On a GPU that work either overlaps the device or caps the step rate.
Each phase is timed by wrapping the engine's own entry points, so the same measurement runs
against any version of the engine:
- schedule: Scheduler.schedule;
- prepare inputs: from ModelRunner.submit's start (execute's, before overlap) to the model's
  forward (or the decode graphs);
- process outputs: the rest of the engine core's step (the scheduler's state update, token stops,
  the per-choice outputs, drafts for the next step); in a tree without an engine core (before
  issue 14's split), the rest of LLMEngine.step less the text processing;
- front end: detokenization and stop strings (OutputProcessor.process; before the split,
  RequestOutputState.process), which run in the front end's process when the core has its own
  (engine.engine_process), so they are reported apart from the host total;
- runner, other: the rest of ModelRunner.submit less the forward, the logits and the sampler
  (on this CPU mostly freeing the step's vocabulary-sized logits, which a GPU's caching
  allocator does in microseconds), reported apart.
Times are the engine thread's CPU time (time.thread_time), so that other processes on a shared
machine do not count; medians over the steps. A tree whose core process tunes the garbage
collector (core_process.tune_gc: start-up objects frozen, a larger young generation) is measured
with it, as its core runs.

Before and after in one run: report_host_time first measures the tree at BEFORE_REV (or each of
--before's comma-separated revisions, extracted with `git archive` into a temporary folder, run in
a subprocess with this same file), then this one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
# The tree before issue 14's step plan and persistent batch (its host time: docs/perf/engine.md).
BEFORE_REV = "49be0ed"


@dataclass
class PhaseClock:
    """Seconds spent per phase in the current step."""
    spent: dict[str, float] = field(default_factory=dict)
    marks: dict[str, float] = field(default_factory=dict)   # first time a phase started this step

    def timed(self, phase: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.thread_time()
            self.marks.setdefault(phase, t0)
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[phase] = self.spent.get(phase, 0.0) + time.thread_time() - t0
        return wrapper


class _TimedModel:
    """The model with its forward and logits timed as device work."""

    def __init__(self, model, clock: PhaseClock) -> None:
        self._model = model
        self._call = clock.timed("device", model.__call__)
        self.compute_logits = clock.timed("device", model.compute_logits)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def host_time_per_step(num_seqs: int, steps: int = 30, prompt_len: int = 32) -> dict[str, float]:
    """Median milliseconds per decode step of num_seqs running sequences, per phase."""
    from services.worker.config import EngineConfig, ModelSourceConfig
    from services.worker.engine.build import build_engine
    from services.worker.engine.sampling_params import SamplingParams

    blocks_per_seq = -(-(prompt_len + steps + 8) // 16) + 1
    built = build_engine(ModelSourceConfig(source="random:tiny", device="cpu"),
                         EngineConfig(num_blocks=num_seqs * blocks_per_seq + 16, max_num_seqs=num_seqs,
                                      max_num_batched_tokens=num_seqs * prompt_len, num_speculative_tokens=0))
    engine = built.engine
    for i in range(num_seqs):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(prompt_len)]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True))
    engine.step()                                        # every prompt prefilled in one step
    assert len(engine.scheduler.running) == num_seqs, "the bench needs every sequence running"
    try:                                                 # the core process's collector settings, where
        from services.worker.engine.core_process import tune_gc   # the tree has them
    except ImportError:
        tune_gc = None
    if tune_gc is not None:
        tune_gc()
    clock = PhaseClock()
    engine.scheduler.schedule = clock.timed("schedule", engine.scheduler.schedule)
    runner, sampler = engine.runner, engine.runner.sampler
    run_step = "submit" if hasattr(runner, "submit") else "execute"     # trees before overlap: execute
    setattr(runner, run_step, clock.timed("execute", getattr(runner, run_step)))
    runner.model = _TimedModel(runner.model, clock)
    sample = "sample_on_device" if hasattr(sampler, "sample_on_device") else "sample"
    setattr(sampler, sample, clock.timed("device", getattr(sampler, sample)))
    if getattr(engine.runner, "decode_graphs", None) is not None:
        graphs = engine.runner.decode_graphs
        graphs.run = clock.timed("device", graphs.run)
    if hasattr(engine, "processor"):                     # the engine core and the front end apart
        engine.processor.process = clock.timed("front", engine.processor.process)
    else:
        from services.worker.engine import output_processor
        output_processor.RequestOutputState.process = clock.timed(
            "front", output_processor.RequestOutputState.process)
    samples: dict[str, list[float]] = {name: [] for name in (
        "schedule", "prepare", "outputs", "host", "front", "device", "runner_other")}
    for _ in range(steps):
        clock.spent.clear()
        clock.marks.clear()
        t0 = time.thread_time()
        outputs = engine.step()
        total = time.thread_time() - t0
        assert len(outputs) == num_seqs
        s = clock.spent
        prepare = clock.marks["device"] - clock.marks["execute"]
        outputs_s = total - s["schedule"] - s["execute"] - s["front"]
        for name, value in (("schedule", s["schedule"]), ("prepare", prepare), ("outputs", outputs_s),
                            ("host", s["schedule"] + prepare + outputs_s), ("front", s["front"]),
                            ("device", s["device"]), ("runner_other", s["execute"] - s["device"] - prepare)):
            samples[name].append(value * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def print_host_time(sizes: tuple[int, ...], label: str = "") -> None:
    for n in sizes:
        t = host_time_per_step(n)
        print(f"{label}host/step {n:3d} seqs: {t['host']:.2f} ms host (schedule {t['schedule']:.2f}, prepare inputs "
              f"{t['prepare']:.2f}, process outputs {t['outputs']:.2f}); front end {t['front']:.2f}; "
              f"runner, other {t['runner_other']:.2f}; forward+sample {t['device']:.2f} ms on this CPU "
              f"(target host <= 1.5 ms at 256)", flush=True)


def report_host_time(sizes: tuple[int, ...] = (64, 256), before: str | None = BEFORE_REV) -> None:
    """Section 6: the tree at `before` (None: skip), then this one, with this file's measurement."""
    for rev in (before or "").split(","):
        if not rev:
            continue
        try:
            measure_tree(rev, sizes)
        except (OSError, subprocess.CalledProcessError) as error:   # no git checkout here, say
            print(f"before  host/step: the tree at {rev} not measured ({error})", flush=True)
    print_host_time(sizes, "after   ")


@contextmanager
def tree_at(rev: str) -> Iterator[Path]:
    """The repository at git revision rev, extracted into a temporary folder (with this checkout's
    generated protos where the tree has none: protos only grow, so an older tree reads them)."""
    with tempfile.TemporaryDirectory(prefix="tree-") as tree:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        if (REPO / "libs" / "llmserve" / "v1").is_dir() and not (Path(tree) / "libs/llmserve/v1").exists():
            subprocess.run(["cp", "-r", str(REPO / "libs/llmserve/v1"), f"{tree}/libs/llmserve/"], check=True)
        yield Path(tree)


def run_in_tree(tree: Path, code: str) -> str:
    """Python code in a subprocess that imports the tree at `tree` (its services, tests, bench);
    -> what it printed."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True, stdout=subprocess.PIPE,
                          text=True).stdout


def measure_tree(rev: str, sizes: tuple[int, ...]) -> None:
    """This measurement against the tree at git revision rev, in a subprocess importing that tree."""
    with tree_at(rev) as tree:
        label = "before  " if rev == BEFORE_REV else f"{rev[:7]:8s}"
        print(run_in_tree(tree, "import runpy, sys; sys.argv = ['host_step', '--no-before', '--label', " f"{label!r}"
                    ", '--sizes', " f"{','.join(map(str, sizes))!r}]; runpy.run_path({str(Path(__file__))!r}, "
                    "run_name='__main__')"), end="", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256")
    parser.add_argument("--before", default=BEFORE_REV, help="git revisions measured first, comma-separated (the 'before')")
    parser.add_argument("--no-before", action="store_true", help="measure only the tree importable here")
    parser.add_argument("--label", default="after   ")
    args = parser.parse_args()
    sizes = tuple(int(n) for n in args.sizes.split(","))
    if args.no_before:
        print_host_time(sizes, args.label)
    else:
        report_host_time(sizes, args.before)


if __name__ == "__main__":
    main()

"""Host time per engine step at a large decode batch (make bench-engine, section 6).

A tiny random model (random:tiny: 2 layers, hidden 64) makes the forward pass nearly free, so
what a step costs is the engine's Python: scheduling, preparing the runner's inputs and
processing the outputs. On a GPU that work either overlaps the device or caps the step rate.
Each phase is timed by wrapping the engine's own entry points, so the same measurement runs
against any version of the engine:
- schedule: Scheduler.schedule;
- prepare inputs: from ModelRunner.execute's start to the model's forward;
- process outputs: the rest of LLMEngine.step (state update, detokenization, stop checks);
- runner, other: the rest of ModelRunner.execute less the forward, the logits and the sampler
  (on this CPU mostly freeing the step's vocabulary-sized logits, which a GPU's caching
  allocator does in microseconds), reported apart.
Times are the engine thread's CPU time (time.thread_time), so that other processes on a shared
machine do not count; medians over the steps.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine
from services.worker.engine.sampling_params import SamplingParams


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
    clock = PhaseClock()
    engine.scheduler.schedule = clock.timed("schedule", engine.scheduler.schedule)
    engine.runner.execute = clock.timed("execute", engine.runner.execute)
    engine.runner.model = _TimedModel(engine.runner.model, clock)
    engine.runner.sampler.sample = clock.timed("device", engine.runner.sampler.sample)
    samples: dict[str, list[float]] = {"schedule": [], "prepare": [], "outputs": [], "host": [], "device": [],
                                       "runner_other": []}
    for _ in range(steps):
        clock.spent.clear()
        clock.marks.clear()
        t0 = time.thread_time()
        outputs = engine.step()
        total = time.thread_time() - t0
        assert len(outputs) == num_seqs
        s = clock.spent
        prepare = clock.marks["device"] - clock.marks["execute"]
        outputs_s = total - s["schedule"] - s["execute"]
        for name, value in (("schedule", s["schedule"]), ("prepare", prepare), ("outputs", outputs_s),
                            ("host", s["schedule"] + prepare + outputs_s), ("device", s["device"]),
                            ("runner_other", s["execute"] - s["device"] - prepare)):
            samples[name].append(value * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def report_host_time(sizes: tuple[int, ...] = (64, 256)) -> None:
    for n in sizes:
        t = host_time_per_step(n)
        print(f"host/step     {n:3d} seqs: {t['host']:.2f} ms host (schedule {t['schedule']:.2f}, prepare inputs "
              f"{t['prepare']:.2f}, process outputs {t['outputs']:.2f}); runner, other {t['runner_other']:.2f}; "
              f"forward+sample {t['device']:.2f} ms on this CPU (target host <= 1.5 ms at 256)")


if __name__ == "__main__":
    report_host_time()

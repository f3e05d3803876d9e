"""What the admission tests drive the real OverloadGuard with: a virtual clock they move by hand,
and a worker's load report of a given decode step line."""

from __future__ import annotations

from llmserve.v1 import worker_pb2


class VirtualClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def report(running: int = 1, base: float = 0.5, per_seq: float = 0.002) -> worker_pb2.LoadReport:
    """A report whose decode step takes base + per_seq x running seconds."""
    step = base + per_seq * running
    return worker_pb2.LoadReport(model="m", running=running, decode_tokens_per_s=1 / step, step_time_s=step,
                                 prefill_tokens_per_s=1000.0, max_num_seqs=64, decode_step_base_s=base,
                                 decode_step_per_seq_s=per_seq)

"""bench/gpu/run.sh --smoke: the GPU benchmark scripts run end to end on tiny shapes (on the CPU
through the Triton interpreter), import nothing the GPU image lacks, and write their reports."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_bench_smoke_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    result = subprocess.run(["bash", "bench/gpu/run.sh", "--smoke"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    correctness = (tmp_path / "gpu_correctness.md").read_text()
    assert correctness.count("| PASS |") == 17 and "FAIL" not in correctness
    assert "engine seeded sampling beside unseeded and greedy rows | tiny | float32 | finish ['length']" in correctness
    assert "decode through padded, eager (no CUDA) vs eager | tiny | float32 | 5/5 sequences equal" in correctness
    assert "split-KV x2" in correctness  # the split path was checked too
    assert "long decode, window 520, backend (split-KV x2)" in correctness   # and with a window
    assert correctness.count("| fused MoE, 7 tokens, top 2 of 8, renormalised | tiny-moe |") == 2

    kernels = (tmp_path / "gpu_kernels.md").read_text()
    rows = [line.split("|")[1:-1] for line in kernels.splitlines() if line[:3] == "| 2"]
    assert [(r[1].strip(), r[4].strip()) for r in rows] == [("40", "unified"), ("600", "split x2")]
    assert all(float(r[5]) > 0 for r in rows)              # a Triton time for every case
    assert all(float(r[10]) < 2e-2 for r in rows)          # and it agreed with the reference

    fused = (tmp_path / "gpu_fused.md").read_text()
    rows = [line.split("|")[1:-1] for line in fused.splitlines() if line.startswith("| ") and "µs" not in line]
    assert sorted((r[0].strip(), int(r[1])) for r in rows) == sorted(
        (op, tokens) for op in ("residual add + RMSNorm", "rotary (q and k)", "SiLU and multiply") for tokens in (1, 7))
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)

    moe = (tmp_path / "gpu_moe.md").read_text()
    rows = [line.split("|")[1:-1] for line in moe.splitlines() if line.startswith("| tiny-moe")]
    assert [int(r[1]) for r in rows] == [1, 7]
    assert all(float(r[3]) > 0 and float(r[7]) > 0 and float(r[9]) < 5e-2 for r in rows)

    window = (tmp_path / "gpu_sliding_window.md").read_text()
    rows = [line.split("|")[1:-1] for line in window.splitlines() if line.startswith(("| decode", "| prefill"))]
    assert len(rows) == 4 and all(float(r[3]) > 0 and float(r[4]) > 0 and float(r[7]) < 2e-2 for r in rows)

    engine = (tmp_path / "gpu_engine.md").read_text()
    assert "batch-1 decode step without CUDA graphs | graphs off" in engine   # the CPU smoke runs the torch backend
    assert "| random:tiny-moe" in engine        # the MoE engine ran, or says why it could not
    assert "| the same with overlap (async scheduling) |" in engine
    assert "| requests whose greedy tokens differ with overlap | 0 of 4 |" in engine

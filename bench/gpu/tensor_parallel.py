"""The engine split over N GPUs of one server (engine.tensor_parallel_size): seeded random weights
of a shape too big for one GPU (default Llama-3-70B, bf16, Triton attention), the product card's
workload and the batch-1 decode step, reported beside the same run at TP 1 where the shape fits.

    python -m bench.gpu.tensor_parallel --tensor-parallel 8 [--shape llama-3-70b]
    python -m bench.gpu.tensor_parallel --tensor-parallel 2 --smoke   # tiny shape, two CPU ranks over gloo

It needs a machine with N GPUs: the machines lent to this project have one, so no figures are
committed (docs/perf/gpu.md). --smoke proves the script (and the ranks' protocol) on the CPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.gpu.engine import decode_batch1, product_workload
from bench.gpu.harness import device_name, markdown_table
from services.worker.config import EngineConfig, ModelSourceConfig


def run(shape: str, size: int, smoke: bool) -> dict:
    from services.worker.engine.build import build_engine
    device = "cuda" if not smoke else "cpu"
    dtype, n, prompt_len, out_len, kv_gb = ("float32", 4, 48, 8, 0.05) if smoke else ("bfloat16", 256, 1000, 300, 60)
    built = build_engine(ModelSourceConfig(source=f"random:{shape}", dtype=dtype, device=device),
                         EngineConfig(attention_backend="torch" if smoke else "triton", kv_cache_memory_gb=kv_gb,
                                      max_num_seqs=n + 2, max_num_batched_tokens=256 if smoke else 8192,
                                      tensor_parallel_size=size, num_threads=1 if smoke else 0))
    try:
        dev = built.device
        per_step, _ = decode_batch1(built.engine, dev, 16 if smoke else 1024, 8 if smoke else 128)
        load = product_workload(built.engine, dev, n, prompt_len, out_len, 2)
        return dict(size=size, step_ms=per_step * 1e3, tps=load["tps"], itl_p50=load["itl_p50"])
    finally:
        if built.parallel is not None:
            built.parallel.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-parallel", type=int, required=True, metavar="N", help="GPUs to split over")
    parser.add_argument("--shape", default=None, help="random model shape (default llama-3-70b; tiny with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny shape, CPU ranks over gloo")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count()
    if not args.smoke and gpus < args.tensor_parallel:
        sys.exit(f"--tensor-parallel {args.tensor_parallel} needs {args.tensor_parallel} GPUs; this machine has {gpus}")
    shape = args.shape or ("tiny" if args.smoke else "llama-3-70b")
    sizes = [args.tensor_parallel] if shape == "llama-3-70b" else [1, args.tensor_parallel]   # 70B: no TP 1
    rows = [run(shape, size, args.smoke) for size in sizes]
    print(f"{shape} on {device_name(torch.device('cuda' if not args.smoke else 'cpu'))}")
    print(markdown_table(["tensor parallel", "batch-1 decode step", "output tokens/s", "inter-token p50"],
                         [(str(r["size"]), f"{r['step_ms']:.2f} ms", f"{r['tps']:,.0f}", f"{r['itl_p50'] * 1e3:.1f} ms")
                          for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fused elementwise kernels against the PyTorch ops the model runs today, at the Llama-3-8B sizes
(hidden 4096, 32 + 8 heads of 128, intermediate 14336, bf16), per number of tokens in the step.

The kernels (services/worker/attention/triton/: residual add + RMSNorm, rotary, SiLU-and-multiply)
are checked by correctness.py but not yet wired into the model: this table is what decides it.
Both sides are timed as CUDA-graph replays, as the engine replays decode steps, so the gain shown
is memory traffic saved, not launches.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from bench.gpu import harness

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 14336
TOKENS = (1, 16, 256, 2048, 8192)
SMOKE_SIZES = (64, 4, 2, 16, 128)
SMOKE_TOKENS = (1, 7)


def main(argv: Sequence[str] | None = None) -> int:
    args = harness.parse_args(__doc__.splitlines()[0], argv)
    device = harness.select_device(args.smoke)
    from services.worker.attention.triton.rms_norm import add_rms_norm
    from services.worker.attention.triton.rotary import apply_rotary as fused_rotary
    from services.worker.attention.triton.silu_mul import silu_and_mul
    from services.worker.model.rotary import RotaryEmbedding, apply_rotary

    hidden, heads, kv_heads, head_dim, intermediate = SMOKE_SIZES if args.smoke else (
        HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE)
    dtype, eps = torch.bfloat16, 1e-5
    rotary = RotaryEmbedding(head_dim, 8192, 500000.0, None, device)
    weight = torch.randn(hidden, device=device).to(dtype)
    rows = []
    for tokens in SMOKE_TOKENS if args.smoke else TOKENS:
        x, residual = (torch.randn(tokens, hidden, device=device).to(dtype) for _ in range(2))
        qk = torch.randn(tokens, heads + kv_heads, head_dim, device=device).to(dtype)
        positions = torch.randint(0, 8192, (tokens,), device=device)
        gate_up = torch.randn(tokens, 2 * intermediate, device=device).to(dtype)

        def eager_norm():
            summed = x + residual
            return F.rms_norm(summed.float(), (hidden,), eps=eps).to(dtype) * weight, summed

        def eager_rotary():
            return apply_rotary(qk, *rotary(positions, dtype))

        def eager_silu():
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up

        cases = [("residual add + RMSNorm", eager_norm, lambda: add_rms_norm(x, residual, weight, eps)),
                 ("rotary (q and k)", eager_rotary, lambda: fused_rotary(qk, positions, rotary.cos, rotary.sin)),
                 ("SiLU and multiply", eager_silu, lambda: silu_and_mul(gate_up))]
        for name, eager, fused in cases:
            t_eager = harness.seconds_per_call([eager], device)
            t_fused = harness.seconds_per_call([fused], device)
            rows.append([name, tokens, f"{t_eager * 1e6:.1f}", f"{t_fused * 1e6:.1f}", f"{t_eager / t_fused:.2f}x"])

    harness.report("gpu_fused.md", f"# Fused elementwise kernels on {harness.device_name(device)}\n\n"
                   f"hidden {hidden}, {heads} + {kv_heads} heads of {head_dim}, intermediate "
                   f"{intermediate}, bfloat16; both sides timed as CUDA-graph replays.\n\n"
                   + harness.markdown_table(["op", "tokens", "PyTorch µs", "Triton µs", "speed-up"], rows))
    harness.check_imports()
    return 0


if __name__ == "__main__":
    sys.exit(main())

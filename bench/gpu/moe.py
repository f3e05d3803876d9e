"""Fused MoE: the Triton grouped-GEMM path against the PyTorch path, at the expert shapes of
Qwen3-30B-A3B (hidden 2048, 128 experts of 768, top 8, renormalised) and Mixtral-8x7B (hidden
4096, 8 experts of 14336, top 2), bf16, per number of tokens in the step.

Few tokens are bound by reading the chosen experts' weights: GB/s = bytes of the distinct experts
the step routes to (gate, up and down) / time, beside a device copy measured in the same run.
Many tokens are bound by math: TFLOP/s = 2 x 3 x hidden x intermediate x tokens x top_k / time.
Triton is timed as CUDA-graph replays (its routing and grouping never read back to the host);
the PyTorch path reads each expert's row count on the host, so it is timed eagerly.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bench.gpu import harness


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    renormalize: bool


SHAPES = [Shape("qwen3-30b-a3b", 2048, 768, 128, 8, True), Shape("mixtral-8x7b", 4096, 14336, 8, 2, True)]
TOKENS = (1, 8, 64, 256, 1024, 4096)
TORCH_MAX_TOKENS = 1024          # the PyTorch path is timed up to this many tokens
SMOKE_SHAPES = [Shape("tiny-moe", 64, 32, 8, 2, True)]
SMOKE_TOKENS = (1, 7)


def main(argv: Sequence[str] | None = None) -> int:
    args = harness.parse_args(__doc__.splitlines()[0], argv)
    device = harness.select_device(args.smoke)
    from services.worker.moe.routing import route
    from services.worker.moe.torch_moe import TorchFusedMoE
    from services.worker.moe.triton_moe import TritonFusedMoE

    dtype = torch.bfloat16
    triton_moe, torch_moe = TritonFusedMoE(), TorchFusedMoE()
    copy = harness.copy_bandwidth(device, (1 << 20) if args.smoke else (2 << 30))
    rows = []
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        w_gate_up = (torch.randn(shape.experts, 2 * shape.intermediate, shape.hidden, device=device,
                                 generator=gen) * shape.hidden ** -0.5).to(dtype)
        w_down = (torch.randn(shape.experts, shape.hidden, shape.intermediate, device=device,
                              generator=gen) * shape.intermediate ** -0.5).to(dtype)
        expert_bytes = 3 * shape.hidden * shape.intermediate * dtype.itemsize
        for tokens in SMOKE_TOKENS if args.smoke else TOKENS:
            x = torch.randn(tokens, shape.hidden, device=device, generator=gen).to(dtype)
            logits = torch.randn(tokens, shape.experts, device=device, generator=gen).to(dtype)
            call = (x, logits, w_gate_up, w_down, shape.top_k, shape.renormalize)
            t_triton = harness.seconds_per_call([lambda: triton_moe(*call)], device)
            t_torch, diff = "", ""
            if tokens <= TORCH_MAX_TOKENS:
                t = harness.seconds_per_call([lambda: torch_moe(*call)], device, graph=False)
                t_torch = f"{t * 1e6:.0f}"
                err = (triton_moe(*call).float() - torch_moe(*call).float()).abs().max().item()
                diff = f"{err:.1e}"
            used = route(logits, shape.top_k, shape.renormalize).experts.unique().numel()
            flops = 2 * 3 * shape.hidden * shape.intermediate * tokens * shape.top_k
            rows.append([shape.name, tokens, used, f"{t_triton * 1e6:.1f}",
                         f"{used * expert_bytes / t_triton / 1e9:.0f}",
                         f"{100 * used * expert_bytes / t_triton / copy:.0f}%",
                         f"{flops / t_triton / 1e12:.1f}", t_torch,
                         f"{float(t_torch) / (t_triton * 1e6):.2f}x" if t_torch else "", diff])

    title = (f"# Fused MoE on {harness.device_name(device)}\n\n"
             f"bfloat16; device copy {copy / 1e9:.0f} GB/s (read + write). `experts`: distinct experts "
             f"the step routes to (random router logits); GB/s counts their weights once. Triton: "
             f"CUDA-graph replays; torch: the eager PyTorch path, with its max abs difference.\n\n")
    harness.report("gpu_moe.md", title + harness.markdown_table(
        ["shape", "tokens", "experts", "Triton µs", "GB/s", "of copy", "TFLOP/s", "torch µs",
         "speed-up", "max diff"], rows))
    harness.check_imports()
    return 0


if __name__ == "__main__":
    sys.exit(main())

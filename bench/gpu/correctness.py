"""Every Triton kernel against its PyTorch reference on this machine's GPU, at the shapes the
engine runs (Llama-3-8B and SmolLM2 attention, each dtype, with and without a sliding window;
Qwen3-30B-A3B and Mixtral experts), before any timing is trusted.

The CPU test suite runs the same kernels under the Triton interpreter, which cannot catch what
only a GPU build gets wrong (layouts, tl.dot lowering, bf16 tensor-core math); this can.
Exits 1 if any check fails.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence

import torch

from bench.gpu import harness

# (name, num_heads, num_kv_heads, head_dim, block_size, dtype)
SHAPES = [("llama3-8b", 32, 8, 128, 16, torch.bfloat16), ("smollm2", 9, 3, 64, 32, torch.float16),
          ("gqa1-fp32", 4, 4, 64, 16, torch.float32)]
SMOKE_SHAPES = [("smollm2", 9, 3, 64, 32, torch.bfloat16)]
# (cached, new) per sequence: decode, prefill, chunked prefill, verification, long prefill.
MIXED = [(37, 1), (0, 17), (20, 13), (50, 1), (40, 4), (1000, 1), (300, 200)]
LONG_DECODE = [(5000, 1), (77, 1), (0, 1)]
SMOKE_MIXED = [(37, 1), (0, 17), (20, 13), (40, 4)]
SMOKE_LONG_DECODE = [(600, 1), (9, 1)]
# Sliding windows checked: one shorter than the mixed batch's longer contexts and the long decode.
WINDOWS = (64, 1024)
SMOKE_WINDOWS = (16, 520)   # 520 of the 601-token decode still splits in two
# MoE layers (name, tokens, hidden, intermediate, experts, top_k, renormalize): Qwen3-30B-A3B and
# Mixtral-8x7B's experts, at a decode-sized and a prefill-sized step.
MOE_SHAPES = [("qwen3-30b-a3b", 5, 2048, 768, 128, 8, True), ("qwen3-30b-a3b", 300, 2048, 768, 128, 8, False),
              ("mixtral-8x7b", 37, 4096, 14336, 8, 2, True)]
SMOKE_MOE_SHAPES = [("tiny-moe", 7, 64, 32, 8, 2, True)]
# The MoE path rounds its intermediate and each expert's output to the storage dtype.
MOE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# Elementwise kernels round once from fp32, like their references; bf16 allows two units in the
# last place, since the interpreter (--smoke) truncates where a GPU rounds to nearest.
ONE_ROUNDING = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}


def main(argv: Sequence[str] | None = None) -> int:
    args = harness.parse_args(__doc__.splitlines()[0], argv)
    device = harness.select_device(args.smoke)
    from services.worker.attention.triton.backend import TritonPagedAttention
    from services.worker.attention.triton.paged_attention import paged_attention
    from tests.worker.paged_batches import TOLERANCE, make_batch, reference_attention

    # On the CPU, pretend to have 8 multiprocessors so that the split-KV path runs too.
    backend = TritonPagedAttention(num_sms=None if device.type == "cuda" else 8)
    mixed, long_decode = (SMOKE_MIXED, SMOKE_LONG_DECODE) if args.smoke else (MIXED, LONG_DECODE)
    windows = SMOKE_WINDOWS if args.smoke else WINDOWS
    rows = []

    def record(check: str, shape: str, dtype: torch.dtype, got: torch.Tensor,
               expected: torch.Tensor, tol: float) -> None:
        """Passes when every element is within tol * (1 + |expected|), as torch.testing does."""
        diff = (got.float() - expected.float()).abs()
        worst = (diff / (tol * (1 + expected.float().abs()) + 1e-30)).max().item()
        ok = not torch.isnan(got).any().item() and worst <= 1
        rows.append([check, shape, str(dtype).removeprefix("torch."), f"{diff.max().item():.2e}",
                     f"{tol:.0e}", f"{worst:.2f}", "PASS" if ok else "FAIL"])

    for name, heads, kv_heads, head_dim, block_size, dtype in SMOKE_SHAPES if args.smoke else SHAPES:
        scale = head_dim ** -0.5
        tol = TOLERANCE[dtype]["atol"]
        for (label, seqs), window in itertools.product((("mixed batch", mixed), ("long decode", long_decode)),
                                                       (None,) + windows):
            batch = make_batch(seqs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                               block_size=block_size, dtype=dtype, shared_blocks=1).to(device)
            meta = batch.meta
            label_w = label if window is None else f"{label}, window {window}"
            expected = reference_attention(batch, scale, window)
            splits = backend.num_splits(meta, kv_heads, device, window)
            path = f"split-KV x{splits}" if splits > 1 else "unified"
            got = backend.attend(batch.query, batch.key_cache, batch.value_cache, meta, scale, window)
            record(f"attention, {label_w}, backend ({path})", name, dtype, got, expected, tol)
            if splits > 1:
                got = paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                      meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                      meta.max_query_len, scale, window=window)
                record(f"attention, {label_w}, unified", name, dtype, got, expected, tol)
        check_elementwise(name, heads, kv_heads, head_dim, dtype, device, record)
    check_moe(SMOKE_MOE_SHAPES if args.smoke else MOE_SHAPES, device, record)
    harness.check_imports()   # the kernels alone; the engine below reads SmolLM2's vocabulary where installed
    check_decode_graphs(device, rows)
    check_seeded_sampling(device, rows)

    harness.report("gpu_correctness.md", f"# Triton kernels against PyTorch on "
                   f"{harness.device_name(device)}\n\n"
                   + harness.markdown_table(["check", "shape", "dtype", "max abs err", "tol",
                                             "worst err / (tol (1 + abs ref))", "result"], rows))
    return 0 if all(row[-1] == "PASS" for row in rows) else 1


def check_elementwise(name, heads, kv_heads, head_dim, dtype, device, record) -> None:
    """write_kv, RMSNorm (+ residual), rotary and SiLU-and-multiply at the model's sizes."""
    from services.worker.attention.torch_paged import TorchPagedAttention
    from services.worker.attention.triton.rms_norm import (
        add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference)
    from services.worker.attention.triton.rotary import apply_rotary, apply_rotary_reference
    from services.worker.attention.triton.silu_mul import silu_and_mul, silu_and_mul_reference
    from services.worker.attention.triton.write_kv import write_kv

    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(device)  # noqa: E731
    tol = ONE_ROUNDING[dtype]
    tokens, hidden = 37, heads * head_dim

    qkv = rand(tokens, heads + 2 * kv_heads, head_dim)
    key, value = qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    slots = torch.randperm(64 * 16, generator=gen)[:tokens].to(device)
    caches = [torch.zeros(64, 16, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(4)]
    write_kv(key, value, caches[0], caches[1], slots)
    TorchPagedAttention().write_kv(key, value, caches[2], caches[3], slots)
    record("write_kv (exact)", name, dtype, torch.cat(caches[:2]), torch.cat(caches[2:]), 0.0)

    x, residual, weight = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
    record("rms_norm", name, dtype, rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5),
           tol)
    got, expected = add_rms_norm(x, residual, weight, 1e-5), add_rms_norm_reference(x, residual,
                                                                                      weight, 1e-5)
    record("add_rms_norm", name, dtype, torch.cat(got), torch.cat(expected), tol)

    angles = torch.outer(torch.arange(4096.0), 500000.0 ** (-torch.arange(0, head_dim, 2) / head_dim))
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(device)
    qk = qkv[:, :heads + kv_heads]
    record("rotary (q and k, strided)", name, dtype, apply_rotary(qk, positions, cos, sin),
           apply_rotary_reference(qk, positions, cos, sin), tol)
    gate_up = rand(tokens, 2 * 4 * hidden)
    record("silu_and_mul", name, dtype, silu_and_mul(gate_up), silu_and_mul_reference(gate_up), tol)


def check_moe(shapes, device, record) -> None:
    """The Triton fused MoE against the PyTorch path on the same inputs upcast to float32."""
    from services.worker.moe.torch_moe import TorchFusedMoE
    from services.worker.moe.triton_moe import TritonFusedMoE

    gen = torch.Generator().manual_seed(0)
    for name, tokens, hidden, intermediate, experts, top_k, renormalize in shapes:
        x = torch.randn(tokens, hidden, generator=gen)
        logits = torch.randn(tokens, experts, generator=gen)
        w_gate_up = torch.randn(experts, 2 * intermediate, hidden, generator=gen) * hidden ** -0.5
        w_down = torch.randn(experts, hidden, intermediate, generator=gen) * intermediate ** -0.5
        for dtype in (torch.bfloat16, torch.float16):
            stored = [t.to(device=device, dtype=dtype) for t in (x, logits, w_gate_up, w_down)]
            got = TritonFusedMoE()(*stored, top_k, renormalize)
            expected = TorchFusedMoE()(*(t.float() for t in stored), top_k, renormalize)
            record(f"fused MoE, {tokens} tokens, top {top_k} of {experts}"
                   f"{', renormalised' if renormalize else ''}", name, dtype, got, expected,
                   MOE_TOLERANCE[dtype])


def check_decode_graphs(device, rows) -> None:
    """The engine's greedy tokens with decode steps replayed from CUDA graphs (padded, eager on
    the CPU) against the same engine without them: float32 weights, so no near-tie decides."""
    from services.worker.attention.triton.backend import TritonPagedAttention
    from services.worker.config import EngineConfig, ModelSourceConfig
    from services.worker.engine.build import build_engine
    from services.worker.engine.sampling_params import SamplingParams
    from services.worker.model.loader import load_model

    loaded = load_model("random:tiny", torch.float32, device, TritonPagedAttention())
    prompts = {f"r{i}": list(range(100 + 50 * i, 100 + 50 * i + length))
               for i, length in enumerate((5, 17, 33, 40, 64))}
    outputs = {}
    for graphs in (0, 4):
        engine = build_engine(ModelSourceConfig(source="random:tiny", device=device.type),
                              EngineConfig(num_blocks=64, max_model_len=512, attention_backend="triton",
                                           cuda_graph_max_batch=graphs), loaded=loaded).engine
        for i, (rid, ids) in enumerate(prompts.items()):
            engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=3 + 3 * i, ignore_eos=True))
        tokens = {rid: [] for rid in prompts}
        while engine.has_work():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
        outputs[graphs] = tokens
    same = sum(outputs[0][r] == outputs[4][r] for r in prompts)
    path = "CUDA graphs" if device.type == "cuda" else "padded, eager (no CUDA)"
    rows.append([f"engine greedy tokens, decode through {path} vs eager", "tiny", "float32",
                 f"{same}/{len(prompts)} sequences equal", "exact", "", "PASS" if same == len(prompts) else "FAIL"])


def check_seeded_sampling(device, rows) -> None:
    """A seeded request sampled beside unseeded and greedy ones on this device: nobody is aborted
    (a generator on another device than the logits fails the step) and the seeded tokens are
    the same as when it runs alone."""
    from services.worker.config import EngineConfig, ModelSourceConfig
    from services.worker.engine.build import build_engine
    from services.worker.engine.sampling_params import SamplingParams

    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    batch = {"seeded": seeded, "unseeded": SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
             "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)}
    runs = {}
    for label, requests in (("batch", batch), ("alone", {"seeded": seeded})):
        engine = build_engine(ModelSourceConfig(source="random:tiny", device=device.type, dtype="float32"),
                              EngineConfig(num_blocks=64, max_model_len=512)).engine
        for i, (rid, params) in enumerate(requests.items()):
            engine.add_request(rid, list(range(200 + 40 * i, 230 + 40 * i)), params)
        tokens, finish = {rid: [] for rid in requests}, {}
        while engine.has_work():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
                if out.finished:
                    finish[out.request_id] = out.finish_reason
        runs[label] = tokens, finish
    (tokens, finish), (alone, _) = runs["batch"], runs["alone"]
    ok = set(finish.values()) == {"length"} and tokens["seeded"] == alone["seeded"]
    rows.append(["engine seeded sampling beside unseeded and greedy rows", "tiny", "float32",
                 f"finish {sorted(set(finish.values()))}, seeded alone = in batch: {tokens['seeded'] == alone['seeded']}",
                 "exact", "", "PASS" if ok else "FAIL"])


if __name__ == "__main__":
    sys.exit(main())

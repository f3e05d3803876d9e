"""The engine on the GPU at a real size: seeded random weights of the Llama-3-8B shape in bf16,
Triton attention, against transformers' generate on the same GPU, shape and workload.

Reports, in one run:
- batch-1 decode memory-bandwidth utilisation: (weight bytes + KV bytes read) per step over step
  time, against the device copy bandwidth measured in the same run (target >= 80%);
- the product card's workload: 256 requests of 1,000 prompt tokens and 300 output tokens at once:
  output tokens/s (target >= 15,000 on one H200), tokens/s per stream (target >= 20), and the TTFT
  p95 of short prompts arriving while that load runs (target < 1 s);
- transformers' generate on the same workload in static batches, as the peer;
- overlap (async scheduling) on and off on a decode-heavy workload, and how many of the overlapped
  steps' submissions synchronised with the device (torch.cuda.set_sync_debug_mode; target 0: a
  submission that waits for the device leaves it idle while the host prepares the next step);
- then the mixture-of-experts engine at random:qwen3-30b-a3b (bf16, Triton attention and fused
  MoE; all 128 experts resident): batch-1 decode step and 64 x (1000 in, 200 out) output tokens/s.

--smoke runs a tiny random model on whatever device there is, to prove the script works.
"""

from __future__ import annotations

import gc
import sys
import time
import warnings

import torch

from bench.gpu.harness import copy_bandwidth, device_name, markdown_table, parse_args, report, select_device
from bench.timing import TokenTimeline, percentile
from services.worker.config import EngineConfig, ModelSourceConfig

TARGETS = {"bw_util": 0.80, "tps": 15000, "per_stream": 20, "ttft_p95": 1.0}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_batch1(engine, device, prompt_len: int, steps: int) -> tuple[float, int]:
    from services.worker.engine.sampling_params import SamplingParams
    engine.add_request("b1", list(range(100, 100 + prompt_len)),
                       SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
    for _ in range(8):      # prefill and warm-up decodes
        engine.step()
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    per_step = (time.perf_counter() - t) / steps
    engine.abort_request("b1")
    return per_step, prompt_len + 8 + steps // 2


def product_workload(engine, device, n: int, prompt_len: int, out_len: int, n_short: int,
                     tokens: dict[str, list[int]] | None = None) -> dict:
    """n long requests at once; n_short short prompts arrive once decoding is under way.
    tokens: filled with each request's output token ids, when given."""
    from services.worker.engine.sampling_params import SamplingParams
    gen = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    timeline = TokenTimeline()
    for i in range(n):
        ids = torch.randint(10, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"long{i}", ids, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    short, steps = [], 0
    while engine.has_work():
        if steps == min(40, out_len // 2):
            for j in range(n_short):
                ids = torch.randint(10, vocab, (32,), generator=gen).tolist()
                engine.add_request(f"short{j}", ids, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
                timeline.arrival[f"short{j}"] = time.perf_counter()
                short.append(f"short{j}")
        outputs = engine.step()
        timeline.observe(outputs)
        if tokens is not None:
            for o in outputs:
                tokens.setdefault(o.request_id, []).extend(o.token_ids)
        steps += 1
    elapsed = timeline.elapsed()
    return dict(tps=timeline.tokens / elapsed, seconds=elapsed, itl_p50=percentile(timeline.gaps, 50),
                ttft_short_p95=percentile(timeline.ttfts(short), 95), steps=steps)


def transformers_peer(cfg, device, n: int, prompt_len: int, out_len: int, batch: int) -> dict | None:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_context_length,
                         tie_word_embeddings=cfg.tie_word_embeddings)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(hf_cfg).to(dtype).eval()
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for start in range(0, n, batch):
        size = min(batch, n - start)
        ids = torch.randint(10, cfg.vocab_size, (size, prompt_len), generator=gen).to(device)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                           min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    sync(device)
    elapsed = time.perf_counter() - t0
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(tps=n * out_len / elapsed, seconds=elapsed)


def overlap_rows(engine, device, n: int, prompt_len: int, out_len: int) -> list[tuple[str, str, str]]:
    """The same workload with overlap on and off, on one engine; and the overlapped submissions
    that synchronised (each a stall the overlap cannot hide)."""
    core, runner = engine.core, engine.runner
    submit, synced, submits = runner.submit, [], []

    def watched(*args):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return submit(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                submits.append(1)
                synced.append(any("synchroniz" in str(w.message) for w in caught))
    tps, tokens = {}, {False: {}, True: {}}
    for overlap in (False, True):
        core.async_scheduling = overlap
        if overlap and device.type == "cuda":
            runner.submit = watched
        tps[overlap] = product_workload(engine, device, n, prompt_len, out_len, 0, tokens[overlap])["tps"]
        runner.submit = submit
    core.async_scheduling = False
    differ = sum(tokens[True].get(rid) != ids for rid, ids in tokens[False].items())
    rows = [(f"{n} x ({prompt_len} in, {out_len} out) without overlap: output tokens/s", f"{tps[False]:.0f}", ""),
            ("the same with overlap (async scheduling)", f"{tps[True]:.0f} ({tps[True] / tps[False]:.2f}x)",
             "> 1x"),
            ("requests whose greedy tokens differ with overlap", f"{differ} of {len(tokens[False])}", "0")]
    rows.append(("overlapped submissions that synchronised with the device",
                 f"{sum(synced)} of {len(submits)}" if device.type == "cuda" else "not measured off CUDA", "0"))
    return rows


MOE_SHAPE, SMOKE_MOE_SHAPE = "qwen3-30b-a3b", "tiny-moe"


def moe_engine_rows(device, smoke: bool) -> list[tuple[str, str, str]]:
    """The MoE engine's batch-1 decode step and a batch workload, at MOE_SHAPE (or, for --smoke,
    a tiny MoE shape) when services/worker/model/shapes.py names it."""
    from services.worker.engine.build import build_engine
    from services.worker.model.shapes import NAMED_SHAPES
    shape = SMOKE_MOE_SHAPE if smoke else MOE_SHAPE
    if shape not in NAMED_SHAPES:
        return [(f"random:{shape}", "not run: services/worker/model/shapes.py has no such shape", "")]
    dtype, n, prompt_len, out_len, kv_gb = ("float32", 4, 48, 8, 0.05) if smoke else ("bfloat16", 64, 1000, 200, 30)
    backend = "triton" if device.type == "cuda" else "torch"
    built = build_engine(ModelSourceConfig(source=f"random:{shape}", dtype=dtype, device=device.type),
                         EngineConfig(attention_backend=backend, kv_cache_memory_gb=kv_gb, max_num_seqs=n,
                                      max_num_batched_tokens=256 if smoke else 8192))
    per_step, _ = decode_batch1(built.engine, device, *((64, 16) if smoke else (1024, 128)))
    load = product_workload(built.engine, device, n, prompt_len, out_len, 0)
    cfg = built.loaded.config
    return [(f"random:{shape} {dtype}: {cfg.num_experts} experts, top {cfg.num_experts_per_tok}, "
             f"{cfg.num_layers} layers", f"{backend} attention and MoE", ""),
            ("MoE batch-1 decode step", f"{per_step * 1e3:.2f} ms ({1 / per_step:.0f} tok/s)", ""),
            (f"MoE {n} x ({prompt_len} in, {out_len} out): output tokens/s", f"{load['tps']:.0f}", ""),
            ("MoE tokens/s per stream (1 / ITL p50)", f"{1 / load['itl_p50']:.1f}", "")]


def main(argv=None) -> int:
    args = parse_args(__doc__, argv)
    device = select_device(args.smoke)
    from services.worker.engine.build import build_engine
    if args.smoke:
        shape, dtype, n, prompt_len, out_len, n_short, kv_gb, hf_batch = "tiny", "float32", 4, 48, 8, 2, 0.05, 4
    else:
        shape, dtype, n, prompt_len, out_len, n_short, kv_gb, hf_batch = "llama-3-8b", "bfloat16", 256, 1000, 300, 32, 60, 64
    backend = "triton" if device.type == "cuda" else "torch"
    built = build_engine(ModelSourceConfig(source=f"random:{shape}", dtype=dtype, device=device.type),
                         EngineConfig(attention_backend=backend, kv_cache_memory_gb=kv_gb, max_num_seqs=n + n_short,
                                      max_num_batched_tokens=8192 if not args.smoke else 256))
    engine, cfg = built.engine, built.loaded.config
    weight_bytes = built.loaded.model.decode_weight_bytes()
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * built.dtype.itemsize
    bw = copy_bandwidth(device, (64 if args.smoke else 4096) * 2**20)

    b1_prompt, b1_steps = (64, 16) if args.smoke else (1024, 128)
    per_step, context = decode_batch1(engine, device, b1_prompt, b1_steps)
    graphs, engine.runner.decode_graphs = engine.runner.decode_graphs, None   # the same step, eager
    eager_step, _ = decode_batch1(engine, device, b1_prompt, b1_steps)
    engine.runner.decode_graphs = graphs
    step_bytes = weight_bytes + kv_per_token * context
    util = step_bytes / per_step / bw
    load = product_workload(engine, device, n, prompt_len, out_len, n_short)
    overlap = overlap_rows(engine, device, n, *((16, 8) if args.smoke else (128, 128)))
    peer = transformers_peer(cfg, device, n, prompt_len, out_len, hf_batch)

    rows = [
        ("batch-1 decode step", f"{per_step * 1e3:.2f} ms ({1 / per_step:.0f} tok/s)", ""),
        ("batch-1 decode step without CUDA graphs", f"{eager_step * 1e3:.2f} ms "
         f"(graphs {eager_step / per_step:.2f}x)" if graphs is not None else "graphs off", ""),
        ("batch-1 bytes per step (weights + KV)", f"{step_bytes / 2**30:.2f} GiB", ""),
        ("batch-1 memory-bandwidth utilisation", f"{util * 100:.0f}%", f">= {TARGETS['bw_util'] * 100:.0f}%"),
        (f"{n} x ({prompt_len} in, {out_len} out): output tokens/s", f"{load['tps']:.0f}", f">= {TARGETS['tps']}"),
        ("tokens/s per stream (1 / ITL p50)", f"{1 / load['itl_p50']:.1f}", f">= {TARGETS['per_stream']}"),
        (f"TTFT p95, {n_short} short prompts under that load", f"{load['ttft_short_p95']:.3f} s",
         f"< {TARGETS['ttft_p95']} s"),
    ]
    if peer is None:
        rows.append(("transformers generate", "not installed", ""))
    else:
        rows.append((f"transformers generate (static batches of {hf_batch})", f"{peer['tps']:.0f} tok/s", ""))
        rows.append(("ratio ours / transformers", f"{load['tps'] / peer['tps']:.2f}x", ""))
    rows += overlap
    del built, engine, graphs    # the MoE engine below needs the memory
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows += moe_engine_rows(device, args.smoke)
    header = (f"# Engine on {device_name(device)}: random:{shape} {dtype}, {backend} attention\n\n"
              f"{time.strftime('%Y-%m-%d %H:%M')}; torch {torch.__version__}; copy bandwidth {bw / 1e9:.0f} GB/s\n\n")
    report("gpu_engine.md", header + markdown_table(("measure", "value", "target"), rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

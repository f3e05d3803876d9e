"""make bench-engine: our engine against Hugging Face transformers on this machine, in one run.

1. Mixed workload: 48 requests arriving together, prompts of 20-600 tokens, outputs of 16-256,
   through our engine (continuous batching) and through transformers' generate in static
   batches of 8 on the same prompts and lengths. Output tokens/s of both and the ratio; TTFT and
   inter-token latency percentiles of ours. Where the CPU attention kernel is built, ours runs a
   second time on the PyTorch reference attention (the kernel's speed-up in the same run).
2. Batch-1 decode tokens/s against the floor set by the model's bytes over the measured memory
   bandwidth, with float32 weights and with int8 weights (model.quantization=int8).
3. 16 concurrent chat streams through a real worker process over gRPC, float32 and int8 weights
   (and through llama-cpp-python's OpenAI server on the same GGUF when that package is installed).
4. The product card's simulation: static against continuous batching on one length
   distribution, saved as docs/perf/batching.png.
5. Constrained decoding: decode tokens/s of json_schema requests against unconstrained ones on
   the same prompts and lengths at batch 1 and 16 (target >= 0.9x), and the compile time of
   typical schemas (the grammar cache's miss cost).
6. Host time per step at 64 and 256 running sequences of a tiny random model: scheduling,
   preparing the runner's inputs and processing outputs (bench/host_step.py; target <= 1.5 ms
   a step at 256).

Usage: python -m bench.engine [--quick] [--skip-hf] [--skip-grpc] [--constrained-only] [--host-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.host_step import report_host_time
from bench.timing import TokenTimeline, percentile
from services.worker.attention.cpu import kernel as cpu_kernel
from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine
from services.worker.engine.sampling_params import Constraint, SamplingParams

REPO = Path(__file__).resolve().parents[1]
# Prompts are cut from this text at random offsets: real words, so tokenization is realistic.
CORPUS = (
    "Serving a language model well is mostly about memory. Every request keeps keys and values for each "
    "token it has seen, in every layer, and decode reads all of them for every new token. Paging that "
    "memory in fixed blocks lets many requests share one pool without fragmentation, and batching their "
    "decode steps reads the weights once for all of them. A scheduler grants each running request the "
    "tokens it lacks, admits waiting ones while there is room, and preempts the newest when blocks run out. "
) * 80


def workload(tokenizer, n: int, seed: int = 0, prompt_tokens: tuple[int, int] = (20, 600),
             output_tokens: tuple[int, int] = (16, 256)) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs: prompts 20-600 tokens, outputs 16-256 (by default)."""
    rng = random.Random(seed)
    corpus = tokenizer.encode(CORPUS)
    out = []
    for _ in range(n):
        plen, olen = rng.randint(*prompt_tokens), rng.randint(*output_tokens)
        start = rng.randint(0, len(corpus) - plen - 1)
        out.append((corpus[start:start + plen], olen))
    return out


def run_ours(engine, requests) -> dict:
    timeline = TokenTimeline()
    for i, (ids, olen) in enumerate(requests):
        engine.add_request(str(i), ids, SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True))
    while engine.has_work():
        timeline.observe(engine.step())
    elapsed, ttft, gaps = timeline.elapsed(), timeline.ttfts(), timeline.gaps
    return dict(tokens=timeline.tokens, seconds=elapsed, tps=timeline.tokens / elapsed,
                ttft_p50=percentile(ttft, 50), ttft_p95=percentile(ttft, 95),
                itl_p50=percentile(gaps, 50), itl_p95=percentile(gaps, 95))


def print_ours(label: str, ours: dict, attention: str, ours_tps: float | None = None) -> None:
    """One line per run of our engine; the reference attention's ends with the kernel's speed-up."""
    versus = f"; the CPU kernel {ours_tps / ours['tps']:.2f}x" if ours_tps else ""
    print(f"{label} {ours['tokens']} tokens in {ours['seconds']:.1f}s = {ours['tps']:.1f} tok/s  "
          f"TTFT p50 {ours['ttft_p50']:.2f}s p95 {ours['ttft_p95']:.2f}s  ITL p50 {ours['itl_p50']*1e3:.0f}ms "
          f"p95 {ours['itl_p95']*1e3:.0f}ms  ({attention} attention{versus})", flush=True)


def run_transformers(hf_model, requests, batch_size: int = 8, pad_id: int = 2) -> dict:
    """Static batches: each batch runs until its longest output is done (left-padded prompts)."""
    useful = sum(olen for _, olen in requests)
    t0 = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b:b + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, _) in enumerate(batch):
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            mask[i, width - len(ids):] = 1
        longest = max(olen for _, olen in batch)
        with torch.no_grad():
            hf_model.generate(input_ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                              do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - t0
    return dict(tokens=useful, seconds=elapsed, tps=useful / elapsed)


def memory_bandwidth_gbs() -> float:
    """Read+write bytes per second of a large tensor copy (the decode floor's denominator)."""
    src = torch.empty(64 * 2**20, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def batch1_decode(engine, tokenizer, tokens: int = 128) -> float:
    ids = tokenizer.encode("Write a long story about a lighthouse keeper.")
    engine.add_request("b1", ids, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    engine.step()                                     # prefill + first token
    t0, produced = time.perf_counter(), 0
    while engine.has_work():
        produced += sum(len(o.token_ids) for o in engine.step())
    return produced / (time.perf_counter() - t0)


def report_batch1(label: str, built, tokens: int, bandwidth_gbs: float) -> None:
    weight_bytes = built.loaded.model.decode_weight_bytes()
    floor_ms = weight_bytes / (bandwidth_gbs * 1e9) * 1e3
    b1 = batch1_decode(built.engine, built.loaded.tokenizer, tokens)
    print(f"batch-1 {label:7s} {torch.get_num_threads()} thread(s) {b1:.1f} tok/s ({1e3 / b1:.1f} ms/token); floor {floor_ms:.1f} ms/token = "
          f"{1e3 / floor_ms:.0f} tok/s ({weight_bytes / 2**20:.0f} MiB at {bandwidth_gbs:.1f} GB/s); "
          f"{floor_ms / (1e3 / b1) * 100:.0f}% of the floor (target >= 50 tok/s)")


TOPICS = ["the ocean", "mountains", "a city at night", "bread", "trains", "the moon", "gardens", "rain"]


async def grpc_streams(address: str, model: str, n: int, max_tokens: int) -> dict:
    import grpc

    from llmserve.v1 import worker_pb2 as pb
    from llmserve.v1 import worker_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.GenerationStub(channel)

        async def one(i: int):
            t0 = time.perf_counter()
            ttft, tokens = None, 0
            request = pb.GenerateRequest(model=model, chat=pb.ChatPrompt(messages=[pb.ChatMessage(
                role="user", content=f"Write a paragraph about {TOPICS[i % len(TOPICS)]}.")]),
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            async for r in stub.Generate(request):
                if r.token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens += len(r.token_ids)
            return ttft, tokens

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    total = sum(r[1] for r in results)
    return dict(tps=total / elapsed, ttft_p50=percentile(ttfts, 50), ttft_p95=percentile(ttfts, 95), seconds=elapsed)


def llama_cpp_peer(gguf: str, n: int, max_tokens: int, eos_token_ids: list[int],
                   prompts: list[tuple[str, int]] | None = None, python: str | None = None,
                   port: int | None = None) -> dict | None:
    """llama-cpp-python's OpenAI server on the same GGUF, if installed (an optional peer; `python`:
    an interpreter that has it, by default this one): the same chat prompts as grpc_streams (or
    `prompts`, (text, max tokens) pairs), all sent at once, greedy, end-of-sequence tokens banned as
    ignore_eos does."""
    if python is None:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            return None
    prompts = prompts or [(f"Write a paragraph about {TOPICS[i % len(TOPICS)]}.", max_tokens) for i in range(n)]
    import subprocess
    import urllib.request

    import httpx
    import openai

    from tests.procs import free_port
    port = port or free_port()
    # By default a new request interrupts the running one; queue them instead, so every stream completes.
    proc = subprocess.Popen([python or sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
                             "--n_ctx", "4096", "--interrupt_requests", "False"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/models", timeout=2).read()
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("llama_cpp.server did not start") from None
                time.sleep(1)

        async def run_all():
            client = openai.AsyncOpenAI(base_url=base, api_key="x")

            async def one(prompt: str, max_tokens: int):
                t0, ttft, finish = time.perf_counter(), None, None
                stream = await client.chat.completions.create(
                    model="x", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                    stream=True, temperature=0,
                    logit_bias={str(t): -100 for t in eos_token_ids})
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        ttft = ttft or time.perf_counter() - t0
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                # Counted by the finish, not by chunks: the server merges the tokens of a character
                # that spans several into one chunk (37 chunks for 64 tokens), and sends no usage.
                return ttft or 0.0, finish
            t0 = time.perf_counter()
            res = await asyncio.gather(*(one(p, m) for p, m in prompts))
            return res, time.perf_counter() - t0

        try:
            res, elapsed = asyncio.run(run_all())
        except (openai.APIError, httpx.HTTPError) as e:   # a server that crashed mid-stream says so here
            raise RuntimeError(f"llama_cpp.server failed ({e!r}; exit code {proc.poll()})") from None
        if any(finish != "length" for _, finish in res):
            raise RuntimeError(f"llama_cpp.server ended streams before max_tokens: {[f for _, f in res]}")
        res = [(ttft, m) for (ttft, _), (_, m) in zip(res, prompts)]
        return dict(tps=sum(r[1] for r in res) / elapsed, ttft_p95=percentile([r[0] for r in res], 95),
                    tokens=sum(r[1] for r in res), seconds=elapsed)
    finally:
        proc.kill()


def batching_simulation(out_png: Path, seed: int = 0) -> dict:
    """Static vs continuous batching on one output-length distribution, in decode steps."""
    rng = random.Random(seed)
    lengths = [max(1, int(rng.expovariate(1 / 120))) for _ in range(512)]
    batch = 16
    static_steps = sum(max(lengths[i:i + batch]) for i in range(0, len(lengths), batch))
    # Continuous: a slot is refilled the step its request finishes.
    slots, queue, steps, busy = [0] * batch, list(lengths), 0, 0
    while queue or any(slots):
        for i in range(batch):
            if slots[i] == 0 and queue:
                slots[i] = queue.pop(0)
        busy += sum(1 for s in slots if s)
        slots = [max(0, s - 1) for s in slots]
        steps += 1
    useful = sum(lengths)
    result = dict(static_steps=static_steps, continuous_steps=steps, static_util=useful / (static_steps * batch),
                  continuous_util=useful / (steps * batch))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        axes[0].hist(lengths, bins=40, color="#4c72b0")
        axes[0].set_title("output lengths (tokens)")
        axes[1].bar(["static", "continuous"], [result["static_util"] * 100, result["continuous_util"] * 100],
                    color=["#dd8452", "#55a868"])
        axes[1].set_ylabel("batch slots doing useful work (%)")
        axes[1].set_title(f"batch {batch}: {static_steps} vs {steps} decode steps")
        fig.tight_layout()
        out_png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_png, dpi=100)
    except ImportError:
        pass
    return result


# A list that cannot close within the measured lengths, so both sides decode the same number of tokens.
LONG_LIST_SCHEMA = {"type": "object", "required": ["items"], "additionalProperties": False, "properties": {
    "items": {"type": "array", "minItems": 100, "items": {
        "type": "object", "required": ["fruit", "qty"], "additionalProperties": False,
        "properties": {"fruit": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"}}}}}}
TYPICAL_SCHEMAS = {
    "person (3 fields)": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                           "email": {"type": "string", "format": "email"}},
                          "required": ["name", "age"]},
    "tool call (nested, enum)": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"const": "get_weather"}, "arguments": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    "order (arrays, $defs, anyOf)": {"type": "object", "$defs": {"item": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1},
        "price": {"type": "number"}}, "required": ["sku", "qty"]}}, "properties": {
        "id": {"type": "string"}, "items": {"type": "array", "items": {"$ref": "#/$defs/item"}},
        "status": {"enum": ["new", "paid", "shipped"]}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["id", "items", "status"]},
    "40 properties": {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]}
                                                       for i in range(40)}, "required": [f"field_{i}" for i in range(40)]},
}


def constrained_decode_tps(engine, tokenizer, batch: int, tokens: int, constraint: Constraint | None) -> float:
    """Decode tokens/s of `batch` greedy requests of `tokens` tokens each (prefill not timed)."""
    for i in range(batch):
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content":
                                                                f"List fruits {TOPICS[i % len(TOPICS)]} would like, as JSON."}]))
        engine.add_request(f"c{i}", ids, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                                                        constraint=constraint))
    engine.step()                                     # prefill + first tokens
    t0, produced = time.perf_counter(), 0
    while engine.has_work():
        produced += sum(len(o.token_ids) for o in engine.step())
    return produced / (time.perf_counter() - t0)


def grammar_work_per_step(engine, tokenizer, constraint: Constraint, batch: int = 16, steps: int = 20) -> None:
    """The grammar's own cost in a batch-16 step, timed alone (robust to a busy machine, unlike the
    ratio): computing the masks as logit biases (overlapped with the forward pass in the engine) and
    adding them to the logits."""
    text = json.dumps({"items": [{"fruit": "apple", "qty": 3}, {"fruit": "pear", "qty": 12}] * 3})[:-3]
    matchers = [engine.grammars.matcher(constraint) for _ in range(batch)]
    tokens = tokenizer.encode(text)
    compute = apply = 0.0
    logits = torch.randn(batch, engine.vocab_size)
    for step in range(steps):
        t0 = time.perf_counter()
        masks = torch.stack([m.masks([])[0] for m in matchers])
        t1 = time.perf_counter()
        logits.add_(masks)
        t2 = time.perf_counter()
        compute, apply = compute + t1 - t0, apply + t2 - t1
        for m in matchers:
            m.accept(tokens[step])
    print(f"grammar work  batch {batch}, per step: masks {1e3 * compute / steps:.2f} ms (on the helper thread, "
          f"during the forward pass), applying them {1e3 * apply / steps:.2f} ms")


def report_constrained(quick: bool) -> None:
    from services.worker.engine.structured.compiler import GrammarCompiler
    built = build_engine(ModelSourceConfig(), EngineConfig(num_blocks=1024, max_num_batched_tokens=1024))
    engine, tokenizer = built.engine, built.loaded.tokenizer
    tokens = 24 if quick else 96
    constraint = Constraint("json_schema", json.dumps(LONG_LIST_SCHEMA))
    for batch in (1, 16):
        # Alternating rounds, best of each: the two sides see the same machine noise.
        free = bound = 0.0
        for _ in range(1 if quick else 3):
            free = max(free, constrained_decode_tps(engine, tokenizer, batch, tokens, None))
            bound = max(bound, constrained_decode_tps(engine, tokenizer, batch, tokens, constraint))
        print(f"constrained   batch {batch:2d}: json_schema {bound:.1f} tok/s vs unconstrained {free:.1f} tok/s = "
              f"{bound / free:.2f}x (target >= 0.9x)")
    grammar_work_per_step(engine, tokenizer, constraint)
    compiler = GrammarCompiler(tokenizer, built.loaded.config.vocab_size)
    t0 = time.perf_counter()
    compiler.compile(Constraint("json_object"))
    print(f"compile       tokenizer tables (once per worker) + json_object {1e3 * (time.perf_counter() - t0):.0f} ms")
    for name, schema in TYPICAL_SCHEMAS.items():
        c = Constraint("json_schema", json.dumps(schema))
        t0 = time.perf_counter()
        compiler.compile(c)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.matcher(c)
        print(f"compile       {name}: {1e3 * cold:.2f} ms cold, {1e6 * (time.perf_counter() - t0):.0f} us a matcher from the cache")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller workload (smoke run)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-grpc", action="store_true")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--constrained-only", action="store_true", help="only section 5")
    parser.add_argument("--host-only", action="store_true", help="only section 6")
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python[server] (`make peers` builds one)")
    args = parser.parse_args()
    n = 8 if args.quick else args.requests
    if args.constrained_only:
        report_constrained(args.quick)
        return
    if args.host_only:
        report_host_time()
        return

    built = build_engine(ModelSourceConfig(), EngineConfig(num_blocks=2048, max_num_batched_tokens=1024,
                                                            max_num_seqs=64))
    engine, tokenizer = built.engine, built.loaded.tokenizer
    requests = workload(tokenizer, n)
    if args.quick:
        requests = [(ids[:60], min(olen, 24)) for ids, olen in requests]
    print(f"# bench-engine  {time.strftime('%Y-%m-%d %H:%M')}  torch threads {torch.get_num_threads()}")
    ours = run_ours(engine, requests)
    with_kernel = cpu_kernel.load() is not None
    print_ours("ours         ", ours, "cpu" if with_kernel else "torch")
    if with_kernel and not args.quick:   # the C kernel against the reference, same run
        reference = build_engine(ModelSourceConfig(), EngineConfig(num_blocks=2048, max_num_batched_tokens=1024,
                                                                   max_num_seqs=64, attention_backend="torch"))
        print_ours("  reference  ", run_ours(reference.engine, requests), "torch", ours["tps"])
        del reference
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        from services.worker.model.gguf_loader import smollm2_gguf_path
        path = smollm2_gguf_path()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32).eval()
        theirs = run_transformers(hf, requests)
        print(f"transformers  {theirs['tokens']} tokens in {theirs['seconds']:.1f}s = {theirs['tps']:.1f} tok/s "
              f"(static batches of 8)")
        print(f"ratio         {ours['tps'] / theirs['tps']:.2f}x  (target >= 3x)")
        del hf
    bw = memory_bandwidth_gbs()
    decode_tokens = 32 if args.quick else 128
    report_batch1("float32", built, decode_tokens, bw)
    del engine, built
    int8 = build_engine(ModelSourceConfig(quantization="int8"), EngineConfig(num_blocks=256))
    # Int8 decode runs many small kernels: one thread saves the OpenMP wake-ups of each (engine.num_threads).
    for threads in (torch.get_num_threads(), 1):
        torch.set_num_threads(threads)
        report_batch1("int8", int8, decode_tokens, bw)
    del int8
    if not args.skip_grpc:
        from tests.procs import worker
        streams, max_tokens = (4, 16) if args.quick else (16, 128)
        workers = {"float32": dict(engine__num_threads="0"),
                   "int8 1 thread": dict(model__quantization="int8", engine__num_threads="1")}
        served = {}
        for label, overrides in workers.items():
            with tempfile.TemporaryDirectory() as tmp, worker(Path(tmp), engine__num_blocks="2048", **overrides) as w:
                g = served[label] = asyncio.run(grpc_streams(w.address, "smollm2-135m-instruct", streams, max_tokens))
            print(f"gRPC worker   {label}: {streams} streams x {max_tokens} tokens: {g['tps']:.1f} tok/s aggregate, "
                  f"TTFT p50 {g['ttft_p50']:.2f}s p95 {g['ttft_p95']:.2f}s (target p95 < 3s)")
        from services.worker.model.gguf_loader import smollm2_gguf_path
        peer = llama_cpp_peer(str(smollm2_gguf_path()), streams, max_tokens, tokenizer.eos_token_ids,
                              python=args.llama_python)
        if peer is None:
            print("llama-cpp     not installed (optional peer: `make peers`, ~7 min build, then --llama-python)")
        else:
            ratios = ", ".join(f"{label} {g['tps'] / peer['tps']:.2f}x" for label, g in served.items())
            print(f"llama-cpp     {peer['tps']:.1f} tok/s aggregate (the GGUF's own 4-bit weights), TTFT p95 "
                  f"{peer['ttft_p95']:.2f}s; ratio {ratios} (target >= 2x)")
    report_constrained(args.quick)
    report_host_time((64,) if args.quick else (64, 256))
    sim = batching_simulation(REPO / "docs" / "perf" / "batching.png")
    print(f"simulation    static {sim['static_steps']} steps ({sim['static_util']*100:.0f}% slots useful) vs "
          f"continuous {sim['continuous_steps']} ({sim['continuous_util']*100:.0f}%); plot docs/perf/batching.png")


if __name__ == "__main__":
    main()

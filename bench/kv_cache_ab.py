"""A float32 model over its own float32 KV cache against a bfloat16 one (engine.kv_cache_dtype),
in one run: bench-load's burst mix (32 requests at once, prompts of 20-400 tokens, answers of
16-160, greedy) through engines in process, for the default model in float32 on every core (what
`make run` serves on a CPU without bfloat16 products) and for the int8 pool on one thread. Rounds
alternate the caches on new prompts, so a machine that slows through the run slows both.

    python -m bench.kv_cache_ab [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from bench.engine import run_ours, workload
from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine

# (label, model config, torch threads): make run's two pools as a CPU without bfloat16 runs them.
POOLS = (("float32, every core", ModelSourceConfig(dtype="float32"), os.cpu_count() or 2),
         ("int8, one thread", ModelSourceConfig(name="smollm2-135m-instruct-int8", quantization="int8"), 1))
CACHES = ("auto", "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for label, model, threads in POOLS:
        torch.set_num_threads(threads)
        engines = {cache: build_engine(model, EngineConfig(kv_cache_dtype=cache, num_threads=threads)).engine
                   for cache in CACHES}
        tokenizer = engines["auto"].tokenizer
        tps: dict[str, list[float]] = {cache: [] for cache in CACHES}
        for n in range(args.rounds):
            requests = workload(tokenizer, 32, seed=100 + n, prompt_tokens=(20, 400), output_tokens=(16, 160))
            for cache in CACHES:
                result = run_ours(engines[cache], requests)
                tps[cache].append(result["tps"])
                print(f"{label}: round {n + 1}, cache {cache:8s} {result['tps']:.1f} tokens/s "
                      f"(TTFT p50 {result['ttft_p50']:.2f} s)", flush=True)
        auto, bf16 = (statistics.median(tps[c]) for c in CACHES)
        rounds = ", ".join(f"{b / a:.2f}x" for a, b in zip(tps["auto"], tps["bfloat16"]))
        print(f"{label}: bfloat16 cache {bf16:.1f} against float32 {auto:.1f} tokens/s, median "
              f"{bf16 / auto:.2f}x (rounds {rounds})", flush=True)
        del engines


if __name__ == "__main__":
    main()

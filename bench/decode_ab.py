"""Batch-1 decode, a burst through the engine and 16 concurrent gRPC streams, this tree against
an older one, in one run (issue 14's "batch-1 decode no slower, 16 gRPC streams at least as
fast"; issue 12's burst).

Each round measures every tree once, in turn, each in a subprocess that imports that tree and runs
its own bench/engine.py's batch1_decode, workload and grpc_streams (unchanged since 49be0ed, so
both trees run the same measurement): a float32 engine in process decoding 128 tokens of one
request (the median of three); bench-load's burst mix (32 requests at once, prompts of 20-400
tokens, answers of 16-160, temperature 1, new prompts each round) through an engine in process in
dtype auto, as `make run`'s default pool (a tree without dtype auto reports none); then a real
worker process (engine.num_threads 0: all cores) serving 16 streams of 128 tokens. Rounds
alternate the trees, so a machine that slows through the run slows both.

    python -m bench.decode_ab [--before 49be0ed] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench.host_step import BEFORE_REV, REPO, run_in_tree, tree_at

MEASURE = """
import asyncio, json, statistics, tempfile, time
from pathlib import Path
from bench.engine import batch1_decode, grpc_streams
from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine
from tests.procs import worker
built = build_engine(ModelSourceConfig(dtype="float32"), EngineConfig(num_blocks=256))
b1 = statistics.median(batch1_decode(built.engine, built.loaded.tokenizer, 128) for _ in range(3))
del built
burst = None
try:
    built = build_engine(ModelSourceConfig(dtype="auto"), EngineConfig())
except ValueError:   # a tree before dtype auto
    pass
else:
    from bench.engine import workload
    from services.worker.engine.sampling_params import SamplingParams
    engine, tokens = built.engine, 0
    start = time.perf_counter()
    for i, (ids, olen) in enumerate(workload(built.loaded.tokenizer, 32, seed=ROUND, prompt_tokens=(20, 400),
                                             output_tokens=(16, 160))):
        engine.add_request(str(i), ids, SamplingParams(temperature=1.0, max_tokens=olen, ignore_eos=True))
    while engine.has_work():
        tokens += sum(len(o.token_ids) for o in engine.step())
    burst = tokens / (time.perf_counter() - start)
    del built
with tempfile.TemporaryDirectory() as tmp, worker(Path(tmp), engine__num_blocks="2048", engine__num_threads="0",
                                                  model__dtype="float32") as w:
    g = asyncio.run(grpc_streams(w.address, "smollm2-135m-instruct", 16, 128))
print(json.dumps(dict(batch1=b1, burst=burst, streams=g["tps"], ttft_p95=g["ttft_p95"])))
"""


def measure(tree, round_: int) -> dict:
    return json.loads(run_in_tree(tree, MEASURE.replace("ROUND", str(round_))).strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE_REV)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {args.before: [], "this tree": []}
    with tree_at(args.before) as old:
        for n in range(args.rounds):
            for label, tree in ((args.before, old), ("this tree", REPO)):
                r = measure(tree, 10 + n)
                runs[label].append(r)
                burst = "none" if r["burst"] is None else f"{r['burst']:.1f} tok/s"
                print(f"round {n + 1} {label:10s} batch-1 float32 {r['batch1']:.1f} tok/s; burst of 32 {burst}; "
                      f"16 gRPC streams x 128 {r['streams']:.1f} tok/s (TTFT p95 {r['ttft_p95']:.2f} s)", flush=True)
    medians = {label: {k: statistics.median(r[k] for r in rs) if rs[0][k] is not None else None
                       for k in ("batch1", "burst", "streams")}
               for label, rs in runs.items()}
    old, new = medians[args.before], medians["this tree"]
    ratios = [f"{name} {new[k]:.1f} vs {old[k]:.1f} tok/s = {new[k] / old[k]:.2f}x"
              for k, name in (("batch1", "batch-1"), ("burst", "burst of 32"), ("streams", "16 streams"))
              if old[k] is not None]
    print(f"median: {'; '.join(ratios)} (target: >= 1x each)")


if __name__ == "__main__":
    main()

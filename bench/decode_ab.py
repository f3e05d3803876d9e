"""Batch-1 decode and 16 concurrent gRPC streams, this tree against an older one, in one run
(issue 14's "batch-1 decode no slower, 16 gRPC streams at least as fast").

Each round measures every tree once, in turn, each in a subprocess that imports that tree and runs
its own bench/engine.py's batch1_decode and grpc_streams (unchanged since 49be0ed, so both trees run
the same measurement): a float32 engine in process decoding 128 tokens of one request (the median of three), then a real
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
import asyncio, json, statistics, tempfile
from pathlib import Path
from bench.engine import batch1_decode, grpc_streams
from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine
from tests.procs import worker
built = build_engine(ModelSourceConfig(dtype="float32"), EngineConfig(num_blocks=256))
b1 = statistics.median(batch1_decode(built.engine, built.loaded.tokenizer, 128) for _ in range(3))
del built
with tempfile.TemporaryDirectory() as tmp, worker(Path(tmp), engine__num_blocks="2048", engine__num_threads="0",
                                                  model__dtype="float32") as w:
    g = asyncio.run(grpc_streams(w.address, "smollm2-135m-instruct", 16, 128))
print(json.dumps(dict(batch1=b1, streams=g["tps"], ttft_p95=g["ttft_p95"])))
"""


def measure(tree) -> dict:
    return json.loads(run_in_tree(tree, MEASURE).strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE_REV)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {args.before: [], "this tree": []}
    with tree_at(args.before) as old:
        for n in range(args.rounds):
            for label, tree in ((args.before, old), ("this tree", REPO)):
                r = measure(tree)
                runs[label].append(r)
                print(f"round {n + 1} {label:10s} batch-1 float32 {r['batch1']:.1f} tok/s; 16 gRPC streams x 128 "
                      f"{r['streams']:.1f} tok/s (TTFT p95 {r['ttft_p95']:.2f} s)", flush=True)
    medians = {label: {k: statistics.median(r[k] for r in rs) for k in ("batch1", "streams")}
               for label, rs in runs.items()}
    old, new = medians[args.before], medians["this tree"]
    print(f"median: batch-1 {new['batch1']:.1f} vs {old['batch1']:.1f} tok/s = {new['batch1'] / old['batch1']:.2f}x; "
          f"16 streams {new['streams']:.1f} vs {old['streams']:.1f} tok/s = {new['streams'] / old['streams']:.2f}x "
          f"(target: >= 1x both)")


if __name__ == "__main__":
    main()

"""The engine alone under one tenant's flood, with and without engine.max_step_time_s.

Tenant A keeps `--streams` requests running (bench-load's mixed prompts, closed loop); after a few
seconds tenant B sends one short chat at a time. Each setting reports B's first-token time at p50
and p95 against B's unloaded one, A's streams' speed at p5, the step times and the tokens/s, all in
one run. Usage: python -m bench.step_budget [--seconds 60] [--step-s 0,0.2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

from bench.engine import workload
from bench.timing import percentile
from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine
from services.worker.engine.fair_queue import FairShare
from services.worker.engine.sampling_params import SamplingParams

SYSTEM = "You are a helpful assistant. Answer the user's question clearly."   # the prefix every chat shares


class Flood:
    """One engine; every request is a new chat (a number after the shared system prompt)."""

    def __init__(self, step_s: float, threads: int) -> None:
        self.engine = build_engine(ModelSourceConfig(dtype="auto"),
                                   EngineConfig(num_threads=threads, max_step_time_s=step_s)).engine
        tokenizer = self.engine.tokenizer
        self.system = tokenizer.encode(SYSTEM)
        self.flood = workload(tokenizer, 32, 0, (20, 400), (16, 160))
        self.short = [ids[:30] for ids, _ in workload(tokenizer, 32, 1, (30, 40), (16, 16))]
        self.numbers = itertools.count(10)
        self.added: dict[str, float] = {}

    def add(self, rid: str, ids: list[int], max_tokens: int, tenant: str) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, self.system + [next(self.numbers) % 1000] + ids, params,
                                share=FairShare(tenant=tenant))
        self.added[rid] = time.monotonic()

    def unloaded_ttft_p95(self, n: int = 8) -> float:
        ttfts = []
        for i in range(n):
            self.add(f"alone{i}", self.short[i], 16, "B")
            first = None
            while self.engine.has_work():
                if self.engine.step() and first is None:
                    first = time.monotonic() - self.added[f"alone{i}"]
            ttfts.append(first)
        return percentile(ttfts[2:], 95)   # the first ones warm up

    def run(self, streams: int, seconds: float) -> dict:
        unloaded = self.unloaded_ttft_p95()
        first, last, tokens = {}, {}, {}
        light, light_ttft, steps, total = None, [], [], 0
        floods = itertools.count()

        def next_flood() -> None:
            i = next(floods)
            ids, max_tokens = self.flood[i % len(self.flood)]
            self.add(f"a{i}", ids, max_tokens, "A")

        for _ in range(streams):
            next_flood()
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            if light is None and time.monotonic() - start > 5:   # the flood fills the engine first
                light = f"b{len(light_ttft)}"
                self.add(light, self.short[len(light_ttft) % len(self.short)], 16, "B")
            began = time.monotonic()
            outputs = self.engine.step()
            now = time.monotonic()
            steps.append(now - began)
            for out in outputs:
                rid = out.request_id
                if out.token_ids:
                    total += len(out.token_ids)
                    first.setdefault(rid, now)
                    last[rid] = now
                    tokens[rid] = tokens.get(rid, 0) + len(out.token_ids)
                if out.finished:
                    if rid == light:
                        light_ttft.append(first[rid] - self.added[rid])
                        light = None
                    else:
                        next_flood()
        elapsed = time.monotonic() - start
        speeds = [(tokens[r] - 1) / (last[r] - first[r]) for r in last
                  if r.startswith("a") and tokens[r] > 2 and last[r] > first[r]]
        return dict(b_unloaded_ttft_p95=unloaded, b_requests=len(light_ttft),
                    b_ttft_p50=statistics.median(light_ttft), b_ttft_p95=percentile(light_ttft, 95),
                    b_ttft_ratio=percentile(light_ttft, 95) / unloaded, a_speed_p5=percentile(speeds, 5),
                    tokens_per_s=total / elapsed, step_p50=statistics.median(steps),
                    step_p95=percentile(steps, 95), step_max=max(steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--step-s", default="0,0.2", help="engine.max_step_time_s values, comma-separated")
    args = parser.parse_args()
    for step_s in (float(s) for s in args.step_s.split(",")):
        row = Flood(step_s, args.threads).run(args.streams, args.seconds)
        print(json.dumps({"max_step_time_s": step_s, **{k: round(v, 3) for k, v in row.items()}}), flush=True)


if __name__ == "__main__":
    main()

"""Router benchmark: multi-turn chat over real CPU workers, cache-aware routing against round-robin.

Many users chat at once, each conversation growing turn by turn (every user message brings new
notes to read), so every turn's prompt extends the previous one. The same conversations run through a
cache-aware router and a round-robin router in front of the same workers; a per-policy cache salt
keeps one run from warming the workers' prefix caches for the other. Reports the prefix-cache
hit rate, TTFT p50/p95 and throughput, and the ratios the issue asks for.

The hit rate is vLLM's: cached prompt tokens / prompt tokens, summed over requests from each
answer's usage. The workers' own counters (vllm:prefix_cache_hits / _queries, which also count a
preempted request's second lookup) are read before and after each policy and printed beside it.

    python -m bench.router [--workers 8] [--users 48] [--turns 6] [--max-tokens 12] [--kv-blocks 160]

The default shape is the regime routing is for: six users a worker, whose conversations all fit
in the pool's caches together but not in any single worker's (round-robin makes every worker hold
every conversation, so its copies evict one another); the report prints the conversations' final
size in KV blocks beside the caches' so this can be checked. Each worker runs one torch thread
with passive OpenMP waiting (tests.procs.worker_env).

Round-robin lands a turn on the worker that served the previous one about one time in `workers`,
and the first block (the shared system prompt) is a hit under any policy. With few users a worker
(three, the earlier default) every worker's cache also keeps older turns of every conversation,
and round-robin's hit rate stays at 27-34% (docs/perf/router.md has both shapes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from math import ceil
from pathlib import Path

import grpc

from llmserve.v1 import worker_pb2, worker_pb2_grpc
from services.router.app import Router
from services.router.config import HealthConfig, PolicyConfig, PoolConfig, RouterConfig, ServerConfig
from tests.router.real_workers import start_workers

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a helpful assistant. Read the user's notes carefully and answer in a few words."
WORDS = ("river stone harbor lantern copper meadow signal orbit velvet thunder cedar marble "
         "compass ember glacier hollow island jasmine kettle ledger mosaic nectar").split()
POLICIES = ("round_robin", "cache_aware")
BLOCK_TOKENS = 16   # the workers' KV block size (engine default)


@dataclass
class Phase:
    policy: str
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    final_tokens: dict[int, int] = field(default_factory=dict)   # user -> tokens after the last turn
    last_worker: dict[int, str] = field(default_factory=dict)    # user -> worker of the last turn
    stayed: int = 0             # turns after the first served by the previous turn's worker
    counters: worker_pb2.LoadReport = field(default_factory=worker_pb2.LoadReport)  # workers' deltas

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    @property
    def stay_rate(self) -> float:
        return self.stayed / max(1, len(self.ttft_s) - len(self.last_worker))

    def ttft(self, q: float) -> float:
        return statistics.quantiles(self.ttft_s, n=100, method="inclusive")[q - 1]

    @property
    def counter_hit_rate(self) -> float:
        return self.counters.prefix_cache_hits / max(1, self.counters.prefix_cache_queries)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s

    @property
    def requests_per_s(self) -> float:
        return len(self.ttft_s) / self.wall_s


def user_message(rng: random.Random, user: int, turn: int, words: int) -> str:
    notes = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"User {user}, notes part {turn + 1}: {notes}. Which word came first in this part?"


async def converse(stub: worker_pb2_grpc.GenerationStub, user: int, args, phase: Phase) -> None:
    """One user's conversation: each turn adds the reply and a new message of notes."""
    rng = random.Random(user)   # the same conversation under every policy
    await asyncio.sleep(user * args.arrival_s)   # users arrive over time, not as one thundering herd
    messages = [("system", SYSTEM)]
    for turn in range(args.turns):
        messages.append(("user", user_message(rng, user, turn, args.words)))
        request = worker_pb2.GenerateRequest(
            model=MODEL, cache_salt=phase.policy,
            chat=worker_pb2.ChatPrompt(messages=[worker_pb2.ChatMessage(role=r, content=c) for r, c in messages]),
            sampling=worker_pb2.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
        start = time.perf_counter()
        ttft, text, previous = None, [], phase.last_worker.get(user)
        async for response in stub.Generate(request, timeout=600):
            if ttft is None and response.token_ids:
                ttft = time.perf_counter() - start
            text.append(response.text)
            phase.last_worker[user] = response.worker or phase.last_worker.get(user, "")
            if response.HasField("usage"):
                usage = response.usage
                phase.prompt_tokens += usage.prompt_tokens
                phase.cached_tokens += usage.cached_prompt_tokens
                phase.completion_tokens += usage.completion_tokens
                phase.final_tokens[user] = usage.prompt_tokens + usage.completion_tokens
        phase.ttft_s.append(ttft)
        phase.stayed += previous == phase.last_worker[user]
        messages.append(("assistant", "".join(text)))
        # Reading and typing, exponential like real users'. The spread matters: with think times
        # much shorter than a round of all users' turns, users keep their order, and with as many
        # users as a multiple of the workers round-robin would hand a user the same worker every
        # turn. "same worker" in the report checks it: about 1 / workers for round-robin.
        if turn < args.turns - 1:
            await asyncio.sleep(rng.expovariate(1 / args.think_s))


async def run_phase(policy: str, addresses: list[str], args) -> Phase:
    router = Router(RouterConfig(
        server=ServerConfig(port=0, metrics_port=0),
        models={MODEL: PoolConfig(addresses=addresses)},
        health=HealthConfig(interval_s=0.5),
        policy=PolicyConfig(name=policy)))
    await router.start()
    phase = Phase(policy)
    before = await worker_counters(addresses)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stub = worker_pb2_grpc.GenerationStub(channel)
            start = time.perf_counter()
            await asyncio.gather(*(converse(stub, user, args, phase) for user in range(args.users)))
            phase.wall_s = time.perf_counter() - start
    finally:
        await router.stop(0)
    after = await worker_counters(addresses)
    for name in COUNTERS:
        setattr(phase.counters, name, getattr(after, name) - getattr(before, name))
    return phase


COUNTERS = ("prefix_cache_hits", "prefix_cache_queries", "num_preemptions")


async def worker_counters(addresses: list[str]) -> worker_pb2.LoadReport:
    """The workers' cumulative prefix-cache and preemption counters, summed."""
    total = worker_pb2.LoadReport()
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            load = await worker_pb2_grpc.GenerationStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=60)
        for name in COUNTERS:
            setattr(total, name, getattr(total, name) + getattr(load, name))
    return total


async def warm_up(addresses: list[str]) -> None:
    """One request per worker first, so neither policy pays for the workers' first steps."""
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            request = worker_pb2.GenerateRequest(model=MODEL, text="warm up " * 40, cache_salt="warm-up",
                                                 sampling=worker_pb2.SamplingParams(max_tokens=4))
            [_ async for _ in worker_pb2_grpc.GenerationStub(channel).Generate(request, timeout=600)]


def report(phases: dict[str, Phase], args) -> None:
    ca = phases["cache_aware"]
    blocks = {user: ceil(t / BLOCK_TOKENS) for user, t in ca.final_tokens.items()}
    per_worker = Counter()
    for user, worker in ca.last_worker.items():
        per_worker[worker] += blocks[user]
    print(f"\nrouter benchmark: {args.workers} CPU workers, {args.users} users x {args.turns} turns, "
          f"{args.words} words of notes a turn, max_tokens {args.max_tokens}")
    print(f"KV cache: {args.kv_blocks} blocks per worker, {args.kv_blocks * args.workers} in the pool; "
          f"the conversations' final size is {sum(blocks.values())} blocks in all, "
          f"at most {max(per_worker.values())} on one worker under cache_aware")
    print(f"{'policy':<12} {'requests':>8} {'hit rate':>9} {'(workers)':>9} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'tok/s':>7} {'req/s':>6} {'wall s':>7} {'preempt':>7} {'same worker':>11}")
    for p in phases.values():
        print(f"{p.policy:<12} {len(p.ttft_s):>8} {p.hit_rate:>9.1%} {p.counter_hit_rate:>9.1%} "
              f"{p.ttft(50):>8.3f}s {p.ttft(95):>8.3f}s {p.tokens_per_s:>7.1f} {p.requests_per_s:>6.2f} "
              f"{p.wall_s:>7.1f} {p.counters.num_preemptions:>7} {p.stay_rate:>11.0%}")
    rr = phases["round_robin"]
    hit_ratio = ca.hit_rate / rr.hit_rate if rr.hit_rate else float("inf")
    p95_cut = 1 - ca.ttft(95) / rr.ttft(95)
    print(f"\ncache-aware vs round-robin: hit rate x{hit_ratio:.1f} (target >= 3), "
          f"TTFT p95 {p95_cut:.0%} lower (target >= 30%), throughput x{ca.tokens_per_s / rr.tokens_per_s:.2f}")


async def bench(args, addresses: list[str]) -> None:
    await warm_up(addresses)
    phases = {policy: await run_phase(policy, addresses, args) for policy in POLICIES}
    report(phases, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--users", type=int, default=48)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--words", type=int, default=20, help="words of notes in each user message")
    parser.add_argument("--think-s", type=float, default=8.0, help="mean seconds a user waits between turns")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--arrival-s", type=float, default=0.25, help="seconds between users' arrivals")
    parser.add_argument("--kv-blocks", type=int, default=160, help="KV blocks (16 tokens) per worker")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        workers = start_workers(stack, Path(tmp), args.workers, engine__num_blocks=str(args.kv_blocks),
                                engine__block_size=str(BLOCK_TOKENS))
        asyncio.run(bench(args, [w.address for w in workers]))


if __name__ == "__main__":
    main()

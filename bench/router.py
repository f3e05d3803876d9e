"""Router benchmark: multi-turn chat over real CPU workers, cache-aware routing against round-robin.

Many users chat at once, each conversation growing turn by turn (every user message brings new
notes to read), so every turn's prompt extends the previous one. The same conversations run through a
cache-aware router and a round-robin router in front of the same workers; a per-policy cache salt
keeps one run from warming the workers' prefix caches for the other. Reports the workers'
prefix-cache hit rate, TTFT p50/p95 and throughput, and the ratios the issue asks for.

    python -m bench.router [--workers 2] [--users 12] [--turns 5] [--max-tokens 12] [--kv-blocks 144]

The default shape is the regime routing is for: all conversations fit in the workers' caches
together but not in any single one (round-robin makes every worker hold every conversation).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
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


@dataclass
class Phase:
    policy: str
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    def ttft(self, q: float) -> float:
        return statistics.quantiles(self.ttft_s, n=100, method="inclusive")[q - 1]

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
        ttft, text = None, []
        async for response in stub.Generate(request, timeout=600):
            if ttft is None and response.token_ids:
                ttft = time.perf_counter() - start
            text.append(response.text)
            if response.HasField("usage"):
                phase.prompt_tokens += response.usage.prompt_tokens
                phase.cached_tokens += response.usage.cached_prompt_tokens
                phase.completion_tokens += response.usage.completion_tokens
        phase.ttft_s.append(ttft)
        messages.append(("assistant", "".join(text)))
        # Reading and typing: also keeps users from settling into a lockstep order that would
        # hand round-robin the same worker for a user every turn.
        await asyncio.sleep(rng.uniform(0, args.think_s))


async def run_phase(policy: str, addresses: list[str], args) -> Phase:
    router = Router(RouterConfig(
        server=ServerConfig(port=0, metrics_port=0),
        models={MODEL: PoolConfig(addresses=addresses)},
        health=HealthConfig(interval_s=0.5),
        policy=PolicyConfig(name=policy)))
    await router.start()
    phase = Phase(policy)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stub = worker_pb2_grpc.GenerationStub(channel)
            start = time.perf_counter()
            await asyncio.gather(*(converse(stub, user, args, phase) for user in range(args.users)))
            phase.wall_s = time.perf_counter() - start
    finally:
        await router.stop(0)
    return phase


async def warm_up(addresses: list[str]) -> None:
    """One request per worker first, so neither policy pays for the workers' first steps."""
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            request = worker_pb2.GenerateRequest(model=MODEL, text="warm up " * 40, cache_salt="warm-up",
                                                 sampling=worker_pb2.SamplingParams(max_tokens=4))
            [_ async for _ in worker_pb2_grpc.GenerationStub(channel).Generate(request, timeout=600)]


def report(phases: dict[str, Phase], args) -> None:
    print(f"\nrouter benchmark: {args.workers} CPU workers, {args.users} users x {args.turns} turns, "
          f"max_tokens {args.max_tokens}, {args.kv_blocks} KV blocks per worker")
    print(f"{'policy':<12} {'requests':>8} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'tok/s':>7} {'req/s':>6} {'wall s':>7}")
    for p in phases.values():
        print(f"{p.policy:<12} {len(p.ttft_s):>8} {p.hit_rate:>9.1%} {p.ttft(50):>8.3f}s {p.ttft(95):>8.3f}s "
              f"{p.tokens_per_s:>7.1f} {p.requests_per_s:>6.2f} {p.wall_s:>7.1f}")
    rr, ca = phases["round_robin"], phases["cache_aware"]
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
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--users", type=int, default=12)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--words", type=int, default=20, help="words of notes in each user message")
    parser.add_argument("--think-s", type=float, default=1.0, help="most seconds a user waits between turns")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--arrival-s", type=float, default=0.25, help="seconds between users' arrivals")
    parser.add_argument("--kv-blocks", type=int, default=144, help="KV blocks (16 tokens) per worker")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        workers = start_workers(stack, Path(tmp), args.workers, engine__num_blocks=str(args.kv_blocks))
        asyncio.run(bench(args, [w.address for w in workers]))


if __name__ == "__main__":
    main()

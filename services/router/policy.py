"""Routing policies: which of a pool's candidate workers takes a request.

Ties always go round-robin over the pool's turn counter, never to the "smallest" worker: sending
every miss to the worker with the least prefix memory is the SGLang bug that made hot spots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .config import PolicyConfig
from .pool import Pool, Worker

Decision = Literal["cache_hit", "cache_miss", "imbalanced", "round_robin", "least_loaded"]


@dataclass
class Choice:
    worker: Worker
    decision: Decision
    matched_blocks: int = 0


def spread(pool: Pool, workers: list[Worker]) -> Worker:
    return workers[pool.next_turn() % len(workers)]


def least_loaded(pool: Pool, workers: list[Worker]) -> Worker:
    low = min(w.load_score for w in workers)
    return spread(pool, [w for w in workers if w.load_score == low])


class Policy:
    def choose(self, pool: Pool, candidates: list[Worker], hashes: list[int]) -> Choice:
        """Picks one of `candidates` (non-empty) for a request whose routing key has `hashes`."""
        raise NotImplementedError


class RoundRobinPolicy(Policy):
    def choose(self, pool: Pool, candidates: list[Worker], hashes: list[int]) -> Choice:
        return Choice(spread(pool, candidates), "round_robin")


class LeastLoadedPolicy(Policy):
    def choose(self, pool: Pool, candidates: list[Worker], hashes: list[int]) -> Choice:
        return Choice(least_loaded(pool, candidates), "least_loaded")


class CacheAwarePolicy(Policy):
    """SGLang's cache-aware routing: prefix affinity unless it overloads, else the least loaded.
    The chosen worker is remembered as holding the request's blocks.

    Unlike SGLang, imbalance is judged for the worker affinity picked, not across the pool: one hot
    worker must not cost every other worker's conversations their cache (SGLang then sends all
    requests to the least loaded). A miss goes to the least loaded anyway.
    """

    def __init__(self, config: PolicyConfig):
        self.config = config

    def choose(self, pool: Pool, candidates: list[Worker], hashes: list[int]) -> Choice:
        choice = self._pick(pool, candidates, hashes)
        pool.prefixes.insert(choice.worker.address, hashes)
        return choice

    def _pick(self, pool: Pool, candidates: list[Worker], hashes: list[int]) -> Choice:
        matched = {w: pool.prefixes.match(w.address, hashes) for w in candidates}
        best = max(matched.values())
        if hashes and best / len(hashes) > self.config.cache_threshold:
            holder = least_loaded(pool, [w for w in candidates if matched[w] == best])
            if not self._overloaded(holder, candidates):
                return Choice(holder, "cache_hit", best)
            worker = least_loaded(pool, candidates)
            return Choice(worker, "imbalanced", matched[worker])
        worker = least_loaded(pool, candidates)
        return Choice(worker, "cache_miss", matched[worker])

    def _overloaded(self, worker: Worker, candidates: list[Worker]) -> bool:
        """SGLang's test, (load - min) > abs and load > rel * min, for this worker's load."""
        low = min(w.load_score for w in candidates)
        load = worker.load_score
        return load - low > self.config.balance_abs_threshold and load > self.config.balance_rel_threshold * low


def make_policy(config: PolicyConfig) -> Policy:
    if config.name == "cache_aware":
        return CacheAwarePolicy(config)
    if config.name == "round_robin":
        return RoundRobinPolicy()
    return LeastLoadedPolicy()

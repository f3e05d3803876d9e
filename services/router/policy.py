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
    """SGLang's cache-aware routing: balance first, then prefix affinity, then the least loaded.
    The chosen worker is remembered as holding the request's blocks."""

    def __init__(self, config: PolicyConfig):
        self.config = config

    def choose(self, pool: Pool, candidates: list[Worker], hashes: list[int]) -> Choice:
        choice = self._pick(pool, candidates, hashes)
        pool.prefixes.insert(choice.worker.address, hashes)
        return choice

    def _pick(self, pool: Pool, candidates: list[Worker], hashes: list[int]) -> Choice:
        loads = [w.load_score for w in candidates]
        high, low = max(loads), min(loads)
        if high - low > self.config.balance_abs_threshold and high > self.config.balance_rel_threshold * low:
            return Choice(least_loaded(pool, candidates), "imbalanced")
        matched = {w: pool.prefixes.match(w.address, hashes) for w in candidates}
        best = max(matched.values())
        if hashes and best / len(hashes) > self.config.cache_threshold:
            holders = [w for w in candidates if matched[w] == best]
            return Choice(least_loaded(pool, holders), "cache_hit", best)
        worker = least_loaded(pool, candidates)
        return Choice(worker, "cache_miss", matched[worker])


def make_policy(config: PolicyConfig) -> Policy:
    if config.name == "cache_aware":
        return CacheAwarePolicy(config)
    if config.name == "round_robin":
        return RoundRobinPolicy()
    return LeastLoadedPolicy()

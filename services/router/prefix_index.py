"""Approximate per-worker memory of the prompt prefixes the router sent there.

A routing key (prompt text, salted) is cut into fixed-size character blocks, each hashed together
with its parent's hash like a prefix cache, so block i's hash stands for the whole prefix up to i.
A worker's score for a request is the run of leading blocks it holds over the request's block count.
It approximates the worker's real prefix cache: it never sees the worker's evictions, only its own,
so each worker's memory is capped at the KV blocks the worker reports (a block of `block_chars`
characters is about one KV block of tokens) and the LRU forgets about when the cache must have.
"""

from __future__ import annotations

from collections import OrderedDict

from llmserve.v1 import worker_pb2


def routing_key(request: worker_pb2.GenerateRequest | worker_pb2.TokenizeRequest) -> str:
    """The prompt as text, rendered the same way every time (the workers' templates need not match)."""
    kind = request.WhichOneof("prompt")
    if kind == "chat":
        return "".join(f"<{m.role}>{m.content}\n" for m in request.chat.messages)
    if kind == "text":
        return request.text
    if kind == "token_ids":
        return ",".join(map(str, request.token_ids.ids))
    return ""


def block_hashes(key: str, salt: str, block_chars: int) -> list[int]:
    """Chained hashes of the key's full blocks. A partial tail is left out, as the workers' caches
    leave out a partial block. The salt seeds the chain, so different salts never share a block."""
    parent = hash(("salt", salt))
    hashes = []
    for start in range(0, len(key) - block_chars + 1, block_chars):
        parent = hash((parent, key[start:start + block_chars]))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Block hashes held per worker in LRU order, each worker bounded to `max_blocks` and to the
    limit set for it (its cache's size)."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._limits: dict[str, int] = {}

    def match(self, worker: str, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` the worker holds."""
        held = self._blocks.get(worker)
        if not held:
            return 0
        matched = 0
        for h in hashes:
            if h not in held:
                break
            matched += 1
        return matched

    def insert(self, worker: str, hashes: list[int]) -> None:
        held = self._blocks.setdefault(worker, OrderedDict())
        # Tail first, so a prefix is always more recent than its suffixes and outlives them:
        # eviction never leaves a suffix whose parent is gone.
        for h in reversed(hashes):
            held[h] = None
            held.move_to_end(h)
        self._trim(worker)

    def set_limit(self, worker: str, blocks: int) -> None:
        """Caps the worker's memory at `blocks` (0: unknown, only max_blocks applies)."""
        self._limits[worker] = blocks
        self._trim(worker)

    def _trim(self, worker: str) -> None:
        held = self._blocks.get(worker)
        limit = min(self.max_blocks, self._limits.get(worker) or self.max_blocks)
        while held and len(held) > limit:
            held.popitem(last=False)

    def drop(self, worker: str) -> None:
        self._blocks.pop(worker, None)
        self._limits.pop(worker, None)

    def size(self, worker: str) -> int:
        return len(self._blocks.get(worker, ()))

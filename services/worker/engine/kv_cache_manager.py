"""Per-request block tables over the block pool, with prefix caching.

A full block's identity is H(parent block hash, its token ids, cache salt), so a block can be
shared only by requests whose whole prefix up to and including it is identical. A block is
registered in the cache as soon as the step that fills it is scheduled: a request admitted in
the same step can already share it, because every layer writes the step's keys and values
before it attends. Until that step has run, its registrations are kept (registered_in_step):
a step that fails takes them back (unregister_step), so no later request hits unwritten KV.

With a sliding window shared by every layer (sliding_window=W), a block that lies wholly before
the window of the first token a step schedules for a request is never read again (a step's
tokens only move forward, speculative rejections included): it goes back to the pool at once and
its place in the block table holds the null block, which the attention kernels never read.
Models with any global layer pass None: all their blocks stay live.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.attention.metadata import first_visible_position
from services.worker.engine.block_pool import BlockPool, KVBlock
from services.worker.engine.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0   # prompt tokens looked up
    hits: int = 0      # of which found in the cache


_NO_BLOCKS: list[KVBlock] = []   # shared, never changed: a request holding no blocks


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool,
                 sliding_window: int | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self._null = pool.blocks[0]   # stands in for blocks released out of the window
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}    # the same tables as ids, kept in step (no rebuild)
        self._hashes: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}      # leading blocks already in the cache (or null)
        self.registered_in_step: list[KVBlock] = []   # since begin_step, their KV not yet written

    def begin_step(self) -> None:
        self.registered_in_step.clear()

    def unregister_step(self) -> None:
        """The step failed: the blocks it registered hold no valid KV, so nobody may find them."""
        for block in self.registered_in_step:
            self.pool.unregister(block)
        self.registered_in_step.clear()

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table, live: read it, never change it (the next allocate does)."""
        return self._block_ids.get(request_id, [])

    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_usable_blocks

    def find_cached_prefix(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks at the start of the request's tokens.

        The last token is never served from the cache: its logits are needed to sample.
        """
        if not self.enable_prefix_caching:
            return [], 0
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hashes = self._hash_blocks(request, max_blocks)
        found: list[KVBlock] = []
        for i, block_hash in enumerate(hashes):
            block = self.pool.lookup(block_hash, self._block_tokens(tokens, i))
            if block is None:
                break
            found.append(block)
        return found, len(found) * self.block_size

    def allocate(self, request: Request, num_new_tokens: int, cached: list[KVBlock] = (),
                 num_tokens_to_cache: int | None = None) -> bool:
        """Give the request blocks for its computed tokens, the cached prefix and num_new_tokens.

        `cached` are prefix blocks from find_cached_prefix, for a request holding no blocks yet.
        Blocks filled by tokens below num_tokens_to_cache (default: all, the caller excludes
        unverified speculative tokens) are registered in the prefix cache.
        Returns False, changing nothing, when the pool has too few free blocks.
        """
        rid = request.request_id
        blocks = self._blocks.get(rid, _NO_BLOCKS)
        end = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        cache_end = end if num_tokens_to_cache is None or num_tokens_to_cache > end else num_tokens_to_cache
        if blocks and end <= len(blocks) * self.block_size and not cached and self.sliding_window is None:
            # A step inside the blocks it holds (most decodes): at most a registration to make,
            # when it fills a block not registered yet.
            if self.enable_prefix_caching and cache_end // self.block_size > self._num_registered.get(rid, 0):
                self._register_full_blocks(request, cache_end)
            return True
        n = max(0, -(-end // self.block_size) - len(blocks) - len(cached))
        revived = sum(1 for b in cached if b.ref_count == 0)   # cached blocks sitting in the free list
        if n + revived > self.pool.num_free_blocks:
            return False
        if not blocks:   # first admission, or re-admission after preemption
            self.stats.queries += request.num_tokens
            self.stats.hits += len(cached) * self.block_size
        self.pool.take(cached)
        blocks = self._blocks.setdefault(request.request_id, [])
        new = list(cached) + self.pool.allocate(n)
        blocks.extend(new)
        self._block_ids.setdefault(request.request_id, []).extend(b.block_id for b in new)
        if self.enable_prefix_caching:
            self._register_full_blocks(request, cache_end)
        if self.sliding_window is not None:
            self._release_out_of_window(blocks, self._block_ids[request.request_id], end - num_new_tokens)
        return True

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        self.pool.free(b for b in reversed(blocks) if b is not self._null)

    def _release_out_of_window(self, blocks: list[KVBlock], block_ids: list[int], first_new_position: int) -> None:
        """Frees the blocks wholly before the window of the step's first new token."""
        dead = first_visible_position(first_new_position, self.sliding_window) // self.block_size
        for i in range(min(dead, len(blocks)) - 1, -1, -1):
            if blocks[i] is self._null:
                break    # released by an earlier step, like every block before it
            self.pool.free([blocks[i]])
            blocks[i], block_ids[i] = self._null, self._null.block_id

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        blocks = self._blocks[request.request_id]
        num_full = min(num_tokens // self.block_size, len(blocks))
        done = self._num_registered.get(request.request_id, 0)
        if num_full <= done:
            return                     # a decode step inside a block: nothing new is full
        hashes = self._hash_blocks(request, num_full)
        tokens = request.all_token_ids
        for i in range(done, num_full):
            if blocks[i].block_hash is None and blocks[i] is not self._null:
                self.pool.register(blocks[i], hashes[i], self._block_tokens(tokens, i))
                self.registered_in_step.append(blocks[i])
        self._num_registered[request.request_id] = num_full

    def _hash_blocks(self, request: Request, num_blocks: int) -> list[int]:
        """Chained hashes of the request's first num_blocks full blocks (memoised per request)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else hash(("root", request.cache_salt))
            hashes.append(hash((parent, self._block_tokens(tokens, i))))
        return hashes[:num_blocks]

    def _block_tokens(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.block_size:(i + 1) * self.block_size])

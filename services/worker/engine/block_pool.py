"""The KV cache's blocks: reference counts, the free list, and the prefix-cache index.

Invariants:
- a block is in the free list iff its ref_count is 0; block 0 is the null block, never handed out;
- the free list is in eviction order (least recently freed first); allocating takes from its
  head, and a block taken that still carried a prefix hash is dropped from the index then;
- a freed block keeps its hash, so a later request with the same prefix can take it back from
  the free list (a cache hit) until it is reused for something else.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: Hashable | None = None   # set once the block is full and its prefix is known
    token_ids: tuple[int, ...] = ()      # the block's tokens, compared on lookup (no hash trust)


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[Hashable, KVBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def lookup(self, block_hash: Hashable, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is not None and block.token_ids == token_ids:
            return block
        return None

    def take(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to blocks found in the cache (reviving them from the free list)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                block.block_hash, block.token_ids = None, ()
            block.ref_count = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; pass a request's blocks tail first so prefixes outlive suffixes."""
        for block in blocks:
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} freed twice"
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def register(self, block: KVBlock, block_hash: Hashable, token_ids: tuple[int, ...]) -> None:
        """Make a full block findable by its prefix hash (first writer wins on duplicates)."""
        if block.block_hash is not None:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self._cached.setdefault(block_hash, block)

    def unregister(self, block: KVBlock) -> None:
        """Make a block unfindable again (its keys and values were never written)."""
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash, block.token_ids = None, ()

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash, block.token_ids = None, ()
        self._cached.clear()

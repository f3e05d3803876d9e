"""Random paged-attention batches for the attention tests (and bench/gpu/correctness.py).

A batch is a list of (cached, new) token counts per sequence. Every sequence's keys and values
are drawn at random and kept densely (`keys[s]`, `values[s]`, [seq_len, num_kv_heads, head_dim])
as well as written into a paged cache whose blocks are scattered in random order, whose first
`shared_blocks` blocks may be shared by all sequences that cache them (a common prefix), and
whose unused slots (tails of last blocks, spare blocks) hold NaN, which a correct kernel never
reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.torch_paged import TorchPagedAttention


@dataclass
class PagedBatch:
    query: torch.Tensor          # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor      # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    meta: AttentionMetadata
    keys: list[torch.Tensor]     # per sequence, dense [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]

    def upcast(self) -> PagedBatch:
        """The same batch in float32: what the reference is computed on."""
        return self._map(lambda t: t.float(), self.meta)

    def to(self, device: torch.device | str) -> PagedBatch:
        m = self.meta
        meta = AttentionMetadata(
            m.query_start_loc.to(device), m.seq_lens.to(device), m.block_tables.to(device),
            m.slot_mapping.to(device), m.max_query_len, m.max_seq_len, m.block_size,
            m.query_lens_cpu, m.seq_lens_cpu)
        return self._map(lambda t: t.to(device), meta)

    def _map(self, f, meta: AttentionMetadata) -> PagedBatch:
        return PagedBatch(f(self.query), f(self.key_cache), f(self.value_cache), meta,
                          [f(k) for k in self.keys], [f(v) for v in self.values])


def make_batch(seqs: list[tuple[int, int]], *, num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype = torch.float32, shared_blocks: int = 0,
               spare_blocks: int = 3, seed: int = 0) -> PagedBatch:
    """seqs: (cached tokens, new tokens) per sequence; the new tokens are the query rows."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    seq_lens = [cached + new for cached, new in seqs]
    query_lens = [new for _, new in seqs]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    sharing = [cached >= shared_blocks * block_size for cached, _ in seqs]

    # Physical block ids in random order: shared prefix blocks first, then each sequence's own.
    num_own = sum(nb - (shared_blocks if share else 0) for nb, share in zip(blocks_per_seq, sharing))
    num_blocks = shared_blocks + num_own + spare_blocks
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    shared_ids, rest = physical[:shared_blocks], physical[shared_blocks:]
    prefix_keys = rand(shared_blocks * block_size, num_kv_heads, head_dim)
    prefix_values = rand(shared_blocks * block_size, num_kv_heads, head_dim)

    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    keys, values = [], []
    for s, (seq_len, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        k = rand(seq_len, num_kv_heads, head_dim)
        v = rand(seq_len, num_kv_heads, head_dim)
        table = []
        if sharing[s]:
            k[:len(prefix_keys)], v[:len(prefix_values)] = prefix_keys, prefix_values
            table += shared_ids
        table += [rest.pop() for _ in range(nb - len(table))]
        block_tables[s, :nb] = torch.tensor(table, dtype=torch.int32)
        for t in range(seq_len):
            key_cache[table[t // block_size], t % block_size] = k[t]
            value_cache[table[t // block_size], t % block_size] = v[t]
        keys.append(k)
        values.append(v)

    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = [int(block_tables[s, t // block_size]) * block_size + t % block_size
             for s, (cached, new) in enumerate(seqs) for t in range(cached, cached + new)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_size=block_size, query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens)
    query = rand(starts[-1], num_heads, head_dim)
    return PagedBatch(query, key_cache, value_cache, meta, keys, values)


def poison_blocks_before_window(batch: PagedBatch, window: int) -> int:
    """Fills with NaN every block that lies wholly before the window of its sequence's first query
    row (blocks that may have gone back to the pool) and is no other sequence's live block;
    returns how many. A kernel that skips them still matches the reference."""
    meta, bs = batch.meta, batch.meta.block_size
    live, dead = set(), set()
    for s, (n, q) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        first = max(0, n - q - window + 1) // bs
        row = meta.block_tables[s].tolist()
        dead.update(row[:first])
        live.update(row[first:-(-n // bs)])
    for block in dead - live:
        batch.key_cache[block] = float("nan")
        batch.value_cache[block] = float("nan")
    return len(dead - live)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN, so rows a kernel forgets to write are caught."""
    return torch.full_like(t, float("nan"))


# Kernel outputs against the float32 reference: the output's own rounding dominates (bf16 keeps
# 8 significant bits, fp16 11; the interpreter truncates fp32 -> bf16 where a GPU rounds to
# nearest), plus the probabilities rounded to 16 bits for P @ V on a GPU.
TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def reference_attention(batch: PagedBatch, scale: float, window: int | None = None) -> torch.Tensor:
    """The PyTorch reference on the batch upcast to float32."""
    exact = batch.upcast()
    return TorchPagedAttention().attend(exact.query, exact.key_cache, exact.value_cache,
                                        batch.meta, scale, window=window)


def assert_matches_reference(out: torch.Tensor, batch: PagedBatch, scale: float,
                             window: int | None = None) -> None:
    expected = reference_attention(batch, scale, window)
    assert out.dtype == batch.query.dtype
    assert not torch.isnan(out).any(), "rows left unwritten (NaN-poisoned output)"
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[batch.query.dtype])

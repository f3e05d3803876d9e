"""What an attention kernel needs to know about one forward pass over the paged KV cache.

The batch is flattened: the new (query) tokens of all sequences lie one after another, sequence
s owning rows query_start_loc[s]:query_start_loc[s+1]. A sequence's new tokens are the last
query_len of its seq_len tokens, so query row j of sequence s sits at position
seq_len[s] - query_len[s] + j and attends causally to positions 0..that position, or, in a
layer with a sliding window of W, to the last W of them (first_visible_position).
Decode rows have one query token, prefill and chunked-prefill rows many, speculative
verification rows k+1.

KV cache layout, per layer: key_cache and value_cache, each [num_blocks, block_size,
num_kv_heads, head_dim]. Token t of a sequence lives in block block_tables[s, t // block_size]
at offset t % block_size; slot = block * block_size + offset.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1], on the model's device
    seq_lens: torch.Tensor         # int32 [num_seqs]: tokens in context after this pass
    block_tables: torch.Tensor     # int32 [num_seqs, max_blocks_per_seq], padded with 0
    slot_mapping: torch.Tensor     # int64 [num_tokens]: cache slot of each new token
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies, so the reference backend can plan without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # What a backend derives from this metadata once per pass and reuses in every layer.
    plans: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


def first_visible_position(position: int, window: int | None) -> int:
    """The earliest position a query at `position` attends to: 0, or with a sliding window of W
    the last W positions including its own (transformers: kv_idx > q_idx - sliding_window)."""
    return 0 if window is None else max(0, position - window + 1)


def check_window(window: int | None) -> None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding window must be a positive int or None, got {window!r}")


def cache_slot(block_ids: list[int], position: int, block_size: int) -> int:
    """The cache slot of a sequence's token at `position`, given the sequence's block table."""
    return block_ids[position // block_size] * block_size + position % block_size


def block_table_array(tables: Sequence[Sequence[int]]) -> np.ndarray:
    """The tables as one int32 [num tables, widest] array padded with block 0 (never read past a
    row's length), filled in one vectorised write rather than per entry (numpy: a small op costs
    a microsecond, a torch one ten)."""
    lengths = np.fromiter((len(t) for t in tables), np.int64, len(tables))
    table = np.zeros((len(tables), int(lengths.max())), np.int32)
    table[np.arange(table.shape[1]) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), np.int32, int(lengths.sum()))
    return table


def slot_mapping(block_table: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """cache_slot of every token at once: token i is at positions[i] of the sequence whose block
    table is block_table[rows[i]]. -> int64 slots."""
    return block_table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size


def padded_block_tables(tables: list[list[int]]) -> list[list[int]]:
    """Block tables as rows of one width, padded with block 0 (never read past a row's length)."""
    width = max(len(table) for table in tables)
    return [list(table) + [0] * (width - len(table)) for table in tables]

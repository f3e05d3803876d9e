"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

At small batch a decode step is bound by kernel launches, not by the GPU: a graph replays the
whole forward pass and the head as one launch. A step of n decode rows runs the graph of the
smallest bucket >= n.

Invariants:
- a graph reads and writes only the static buffers here: a step copies its rows into the first
  n entries and pads the bucket with rows that write no KV (slot -1) and attend to position 0 of
  the null block 0, which the block pool never hands out;
- the attention metadata is the same at capture and at every replay: max_query_len 1 and
  max_seq_len the model's length, so the backend launches the same kernels with the same grid
  (split-KV segments past a row's context are empty); host-side lengths are placeholders, which
  is why only a backend that reads the device tensors (Triton) may run here;
- capture happens only on CUDA. Elsewhere the same padded path runs eagerly, so everything but
  the capture itself is tested on the CPU (under the Triton interpreter).
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch

from services.worker.attention.metadata import AttentionMetadata, block_table_array, slot_mapping
from services.worker.engine.transfer import to_device

log = logging.getLogger(__name__)

PADDING_SLOT = -1


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (vLLM's choice: padding a step costs at
    most 7 rows beyond 8, and each bucket is one more graph to capture and hold)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model, kv_caches, block_size: int, max_model_len: int, max_batch: int,
                 device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = bucket_sizes(max_batch)
        self.device = device
        b = self.sizes[-1]
        # Rows: token id, position, cache slot. Padding: token 0 at position 0, no slot.
        self.rows = torch.zeros(3, b, dtype=torch.long, device=device)
        self.rows[2] = PADDING_SLOT
        # Entries past a row's context are never read, so a step writes only its widest table.
        self.block_tables = torch.zeros(b, -(-max_model_len // block_size), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, num_rows: int) -> bool:
        return num_rows <= self.sizes[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graph, largest first so the smaller ones reuse its memory pool.
        Each bucket runs eagerly first: Triton compiles its kernels outside the capture."""
        if self.device.type != "cuda":
            return
        pool = None
        for size in reversed(self.sizes):
            for _ in range(2):
                self._forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            pool = graph.pool()
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    @torch.inference_mode()
    def run(self, token_ids: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
            block_tables: Sequence[Sequence[int]] | np.ndarray,
            feed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [n, vocab] of n decode rows: row i is token token_ids[i] at positions[i] of the
        sequence whose block table is block_tables[i] (lists, or the runner's batch's int32
        [n, width] array, padded with block 0). feed: (rows, tokens) on the device that replace
        those rows' token ids (a step in flight sampled them). The result is a view of a static
        buffer, valid until the next run."""
        n = len(token_ids)
        size = next(s for s in self.sizes if s >= n)
        table = block_tables if isinstance(block_tables, np.ndarray) else block_table_array(block_tables)
        rows = np.empty((3, n), np.int64)
        rows[0], rows[1] = token_ids, positions
        rows[2] = slot_mapping(table, np.arange(n), rows[1], self.block_size)
        self.rows[:, :n].copy_(to_device(rows, self.device))
        if feed is not None:
            self.rows[0].index_copy_(0, *feed)
        tables = to_device(table, self.device)
        self.rows[:2, n:size] = 0
        self.rows[2, n:size] = PADDING_SLOT
        self.block_tables[:n, :tables.shape[1]].copy_(tables)
        self.block_tables[n:size, 0] = 0
        if size in self._graphs:
            graph, logits = self._graphs[size]
            graph.replay()
            return logits[:n]
        return self._forward(size)[:n]

    def _forward(self, size: int) -> torch.Tensor:
        input_ids, positions, slots = self.rows[:, :size]
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=(positions + 1).to(torch.int32),
            block_tables=self.block_tables[:size], slot_mapping=slots,
            max_query_len=1, max_seq_len=self.max_model_len, block_size=self.block_size,
            query_lens_cpu=[1] * size, seq_lens_cpu=[self.max_model_len] * size)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden)

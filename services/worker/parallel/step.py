"""The messages rank 0 broadcasts to the other ranks, as flat tensors (two broadcasts each):
a fixed header, then a payload.

FORWARD: the runner's prepared forward inputs (token ids, positions, and the attention metadata:
cache slots, query starts, sequence lengths, block tables), all int64 in one payload; every rank
runs the same pass over its shard and its share of the KV cache, with the same block tables.
LOGITS: the hidden rows whose logits rank 0 samples (each rank computes its vocabulary slice of
them and the slices are gathered). NOOP keeps the receivers' waits under the collective timeout
while the engine is idle; STOP ends them.
"""

from __future__ import annotations

import torch

from services.worker.attention.metadata import AttentionMetadata

NOOP, FORWARD, LOGITS, STOP = range(4)
HEADER = 8   # kind, tokens, sequences, block-table width, max query len, max seq len, rows, hidden


def header(kind: int, *fields: int) -> torch.Tensor:
    values = [kind, *fields]
    return torch.tensor(values + [0] * (HEADER - len(values)), dtype=torch.long)


def pack_forward(ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    tables = meta.block_tables
    payload = torch.cat([ids.long(), positions.long(), meta.slot_mapping.long(), meta.query_start_loc.long(),
                         meta.seq_lens.long(), tables.long().flatten()])
    return header(FORWARD, ids.numel(), meta.num_seqs, tables.shape[1], meta.max_query_len,
                  meta.max_seq_len), payload


def payload_size(head: list[int]) -> int:
    kind, tokens, seqs, width = head[:4]
    return 3 * tokens + (seqs + 1) + seqs + seqs * width if kind == FORWARD else 0


def unpack_forward(head: list[int], payload: torch.Tensor, block_size: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    _, tokens, seqs, width, max_query_len, max_seq_len = head[:6]
    ids, positions, slots, starts, seq_lens, tables = payload.to(device).split(
        [tokens, tokens, tokens, seqs + 1, seqs, seqs * width])
    starts_cpu, seq_lens_cpu = payload[3 * tokens:3 * tokens + seqs + 1].tolist(), \
        payload[3 * tokens + seqs + 1:3 * tokens + 2 * seqs + 1].tolist()
    meta = AttentionMetadata(
        query_start_loc=starts.int(), seq_lens=seq_lens.int(), block_tables=tables.view(seqs, width).int(),
        slot_mapping=slots, max_query_len=max_query_len, max_seq_len=max_seq_len, block_size=block_size,
        query_lens_cpu=[b - a for a, b in zip(starts_cpu, starts_cpu[1:])], seq_lens_cpu=seq_lens_cpu)
    return ids, positions, meta

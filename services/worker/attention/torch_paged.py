"""Paged attention in plain PyTorch: the CPU path and the reference for the Triton kernels.

Decode rows (one query token) are computed together: their blocks are gathered into a padded
[num_decodes, max_len] view and masked by length. Rows with several query tokens (prefill,
chunked prefill, speculative verification) are computed one sequence at a time with a causal
mask offset by the tokens already in the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.attention.metadata import AttentionMetadata


class TorchPagedAttention:
    name = "torch"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        num_blocks, block_size = key_cache.shape[:2]
        key_cache.view(num_blocks * block_size, *key_cache.shape[2:])[slot_mapping] = key
        value_cache.view(num_blocks * block_size, *value_cache.shape[2:])[slot_mapping] = value

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        starts = _cumsum(meta.query_lens_cpu)
        decode_seqs = [s for s, q in enumerate(meta.query_lens_cpu) if q == 1]
        if decode_seqs:
            rows = torch.tensor([starts[s] for s in decode_seqs], device=query.device)
            out[rows] = self._decode(query[rows], key_cache, value_cache, meta, decode_seqs, scale)
        for s, q_len in enumerate(meta.query_lens_cpu):
            if q_len > 1:
                lo, hi = starts[s], starts[s] + q_len
                out[lo:hi] = self._extend(query[lo:hi], key_cache, value_cache, meta, s, scale)
        return out

    def _decode(self, query, key_cache, value_cache, meta, seqs, scale):
        block_size = meta.block_size
        lens = [meta.seq_lens_cpu[s] for s in seqs]
        max_blocks = -(-max(lens) // block_size)
        tables = meta.block_tables[seqs, :max_blocks].long()             # [B, nb]
        keys = key_cache[tables].flatten(1, 2)                            # [B, nb*bs, Hkv, D]
        values = value_cache[tables].flatten(1, 2)
        length = torch.tensor(lens, device=query.device)
        mask = torch.arange(keys.shape[1], device=query.device)[None, :] < length[:, None]
        # Slots past a sequence's length hold whatever the pool left there, NaN included, and a
        # masked score still multiplies its value (0 * NaN = NaN): zero them.
        keys = keys.masked_fill(~mask[:, :, None, None], 0)
        values = values.masked_fill(~mask[:, :, None, None], 0)
        q = query.unsqueeze(2)                                            # [B, H, 1, D]
        k = keys.transpose(1, 2)                                          # [B, Hkv, L, D]
        v = values.transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None, :],
                                           scale=scale, enable_gqa=True)
        return o.squeeze(2)

    def _extend(self, query, key_cache, value_cache, meta, s, scale):
        block_size = meta.block_size
        seq_len = meta.seq_lens_cpu[s]
        q_len = query.shape[0]
        num_blocks = -(-seq_len // block_size)
        table = meta.block_tables[s, :num_blocks].long()
        keys = key_cache[table].flatten(0, 1)[:seq_len]                   # [L, Hkv, D]
        values = value_cache[table].flatten(0, 1)[:seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(query.transpose(0, 1), keys.transpose(0, 1).to(query.dtype),
                                           values.transpose(0, 1).to(query.dtype), attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        return o.transpose(0, 1)


def _cumsum(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out

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
        plan = meta.plans.get(self.name)
        if plan is None:
            plan = meta.plans[self.name] = _Plan(meta, query.device)
        out = torch.empty_like(query)
        flat_keys = key_cache.flatten(0, 1)                                # [slots, Hkv, D]
        flat_values = value_cache.flatten(0, 1)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._decode(query[plan.decode_rows], flat_keys, flat_values, plan, scale)
        for lo, hi, slots, mask in plan.extends:
            out[lo:hi] = _attention(query[lo:hi].transpose(0, 1), flat_keys[slots].transpose(0, 1),
                                    flat_values[slots].transpose(0, 1), mask, scale).transpose(0, 1)
        return out

    def _decode(self, query, flat_keys, flat_values, plan: "_Plan", scale):
        keys = flat_keys[plan.decode_slots]                               # [B, L, Hkv, D]
        values = flat_values[plan.decode_slots]
        # Slots past a sequence's length hold whatever the pool left there, NaN included, and a
        # masked score still multiplies its value (0 * NaN = NaN): zero them.
        keys = keys.masked_fill(plan.decode_pad, 0).transpose(1, 2)      # [B, Hkv, L, D]
        values = values.masked_fill(plan.decode_pad, 0).transpose(1, 2)
        return _attention(query.unsqueeze(2), keys, values, plan.decode_mask, scale).squeeze(2)


class _Plan:
    """Gather indices and masks of one forward pass, built once and used by every layer.

    Decode rows are gathered into a padded [num_decodes, max_len] view masked by length; each
    row with several query tokens gets its own slots and a causal mask offset by its cache.
    """

    def __init__(self, meta: AttentionMetadata, device: torch.device) -> None:
        bs = meta.block_size
        starts = _cumsum(meta.query_lens_cpu)
        tables = meta.block_tables.to(device=device, dtype=torch.long)
        decodes = [s for s, q in enumerate(meta.query_lens_cpu) if q == 1]
        self.decode_rows = None
        if decodes:
            lens = torch.tensor([meta.seq_lens_cpu[s] for s in decodes], device=device)
            pos = torch.arange(int(lens.max()), device=device)
            seqs = torch.tensor(decodes, device=device)
            self.decode_rows = torch.tensor([starts[s] for s in decodes], device=device)
            self.decode_slots = tables[seqs[:, None], pos[None, :] // bs] * bs + pos % bs
            valid = pos[None, :] < lens[:, None]                          # [B, L]
            self.decode_pad = ~valid[:, :, None, None]
            self.decode_mask = valid[:, None, None, :]
        self.extends = []
        for s, q_len in enumerate(meta.query_lens_cpu):
            if q_len > 1:
                seq_len = meta.seq_lens_cpu[s]
                pos = torch.arange(seq_len, device=device)
                slots = tables[s, pos // bs] * bs + pos % bs
                q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                self.extends.append((starts[s], starts[s] + q_len, slots, pos[None, :] <= q_pos[:, None]))


def _attention(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                          enable_gqa=True)


def _cumsum(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out

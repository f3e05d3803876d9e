"""Paged attention in plain PyTorch: the CPU path and the reference for the Triton kernels.

Sequences are attended in groups, each group's blocks gathered into a padded [rows, max_len]
view under a causal mask offset by the cache: sequences with a few query tokens (decodes,
speculative verification) grouped by query count and similar length, longer ones (prefill,
chunked prefill) one per group. With a sliding window, a sequence's gather starts at the block
holding its first query row's earliest visible position, so blocks wholly outside the window are
neither read nor attended over.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.attention.metadata import AttentionMetadata, check_window, first_visible_position


# Sequences with at most this many new tokens (decodes, speculative verification) are attended in
# padded batches; longer ones (prefill chunks) one at a time, which bounds the padding.
MAX_SHORT_QUERY = 8


class TorchPagedAttention:
    name = "torch"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Rounded to the cache's element type where it is narrower (engine.kv_cache_dtype)."""
        num_blocks, block_size = key_cache.shape[:2]
        key_cache.view(num_blocks * block_size, *key_cache.shape[2:])[slot_mapping] = key.to(key_cache.dtype)
        value_cache.view(num_blocks * block_size, *value_cache.shape[2:])[slot_mapping] = value.to(value_cache.dtype)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        key = (self.name, window)
        plan = meta.plans.get(key)
        if plan is None:
            check_window(window)
            plan = meta.plans[key] = GroupPlan(meta, query.device, window)
        out = torch.empty_like(query)
        attend_groups(plan, query, key_cache, value_cache, scale, out)
        return out


def attend_groups(plan: GroupPlan, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  scale: float, out: torch.Tensor) -> None:
    """The plan's groups of rows, each gathered and attended in one padded batch, into out."""
    for rows, blocks, pad, mask in plan.groups:
        batch, q_len = mask.shape[0], mask.shape[2]
        keys, values = plan.gather(key_cache, value_cache, blocks, batch, pad)
        q = query[rows].view(batch, q_len, *query.shape[1:]).transpose(1, 2)
        o = _attention(q, keys.transpose(1, 2), values.transpose(1, 2), mask, scale)
        out[rows] = o.transpose(1, 2).reshape(len(rows), *query.shape[1:])


class GroupPlan:
    """Gather indices and masks of one forward pass, built once and used by every layer.

    Sequences are attended in groups, each gathered into one padded view under a causal mask
    offset by the cache. Whole blocks are gathered with index_select (several times faster on CPU
    than gathering token slots). Short sequences of one query count and similar length share a
    group; a longer one (a prefill chunk) is a group of its own, so no padding multiplies its mask.
    """

    def __init__(self, meta: AttentionMetadata, device: torch.device, window: int | None,
                 short_queries: bool = True) -> None:
        """short_queries=False plans the long sequences only (another kernel takes the others)."""
        starts = _cumsum(meta.query_lens_cpu)
        tables = meta.block_tables.to(device=device, dtype=torch.long)
        by_q_len: dict[int, list[int]] = {}
        groups = []
        for s, q_len in enumerate(meta.query_lens_cpu):
            if q_len <= MAX_SHORT_QUERY:
                if short_queries:
                    by_q_len.setdefault(q_len, []).append(s)
            else:
                groups.append([s])
        # With a window, what a row gathers is at most window + q_len - 1 positions.
        spans = [min(n, q + window - 1) if window else n
                 for n, q in zip(meta.seq_lens_cpu, meta.query_lens_cpu)]
        for seqs in by_q_len.values():
            groups += _similar_lengths(sorted(seqs, key=spans.__getitem__), spans)
        self.groups = [self._group(group, meta, tables, starts, device, window) for group in groups]

    @staticmethod
    def _group(seqs: list[int], meta: AttentionMetadata, tables: torch.Tensor, starts: list[int],
               device: torch.device, window: int | None):
        """-> (query rows, blocks to gather, padded positions to zero, mask [B, 1, Q, L]) of sequences
        that all have Q query tokens: query i of a sequence sees the positions up to its own (the
        last `window` of them). Row b gathers its blocks from first_block[b] on."""
        bs, q_len = meta.block_size, meta.query_lens_cpu[seqs[0]]
        seq_lens = [meta.seq_lens_cpu[s] for s in seqs]
        first = [first_visible_position(n - q_len, window) // bs for n in seq_lens]
        lens = torch.tensor(seq_lens, device=device)
        first_block = torch.tensor(first, device=device)
        num_blocks = max(-(-n // bs) - f for n, f in zip(seq_lens, first))
        table_cols = first_block[:, None] + torch.arange(num_blocks, device=device)[None, :]   # [B, N]
        block_used = table_cols * bs < lens[:, None]
        table_rows = tables[torch.tensor(seqs, device=device)[:, None],
                            table_cols.clamp(max=tables.shape[1] - 1)]
        # Table padding points at the row's own first block: real data, never out of range.
        blocks = torch.where(block_used, table_rows, table_rows[:, :1]).flatten()
        positions = (first_block * bs)[:, None] + torch.arange(num_blocks * bs, device=device)[None, :]
        valid = positions < lens[:, None]                                           # [B, L]
        pad = (~valid).flatten().nonzero().squeeze(1)    # positions in the [B * L] gather
        last_seen = lens[:, None] - q_len + torch.arange(q_len, device=device)[None, :]    # [B, Q]
        mask = positions[:, None, :] <= last_seen[:, :, None]                       # [B, Q, L]
        if window is not None:
            mask &= positions[:, None, :] > last_seen[:, :, None] - window
        rows = torch.tensor([starts[s] + i for s in seqs for i in range(q_len)], device=device)
        return rows, blocks, pad, mask[:, None]

    @staticmethod
    def gather(key_cache, value_cache, blocks, rows: int, pad):
        """-> keys, values [rows, tokens, Hkv, D] of the given blocks.

        Slots past a sequence's length hold whatever the pool left there, NaN included, and a
        masked score still multiplies its value (0 * NaN = NaN): the padded positions are zeroed.
        """
        out = []
        for cache in (key_cache, value_cache):
            x = cache.index_select(0, blocks).view(-1, *cache.shape[2:])
            x.index_fill_(0, pad, 0)
            out.append(x.view(rows, -1, *cache.shape[2:]))
        return out


def _attention(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                          enable_gqa=True)


def _similar_lengths(seqs: list[int], seq_lens: list[int], max_groups: int = 4) -> list[list[int]]:
    """Split sequences sorted by length into at most max_groups runs, each padded to its own longest.

    One padded batch of mixed lengths gathers and attends over max_len per row; cutting where
    lengths jump by half bounds the padding, and the cap bounds the extra launches per layer.
    """
    groups: list[list[int]] = []
    for s in seqs:
        if groups and (seq_lens[s] <= 1.5 * seq_lens[groups[-1][0]] or len(groups) == max_groups):
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def _cumsum(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out

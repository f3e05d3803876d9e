"""The unified Triton paged-attention kernel against the PyTorch reference (under the Triton
interpreter on CPU). Every batch has scattered blocks, a prefix block shared by its sequences,
partially filled last blocks and NaN in unused slots; outputs start NaN-filled."""

import math

import pytest
import torch

from services.worker.attention.backend import select_backend
from services.worker.attention.triton.paged_attention import paged_attention
from tests.worker.paged_batches import assert_matches_reference, make_batch, poisoned_like

# The interpreter turns a loop bound held in a tensor into an int in a way NumPy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

BATCHES = {
    # (cached, new) per sequence; contexts mostly not a multiple of the block size (one is 16).
    "decode": [(37, 1), (16, 1), (0, 1), (70, 1)],
    "verify": [(45, 4), (12, 4), (33, 4)],  # speculative: k + 1 = 4 query tokens
    "mixed": [(37, 1), (0, 17), (20, 13), (50, 1), (40, 4)],  # decode, prefill, chunk, verify
}

# (num_heads, num_kv_heads, head_dim, block_size, dtype): GQA 1, 3, 8 x head 64, 128 x block 16,
# 32 x fp32, fp16, bf16, each pair of choices met at least once.
SHAPES = [
    (4, 4, 64, 16, torch.float32),
    (9, 3, 64, 32, torch.float16),    # SmolLM2-135M
    (8, 1, 128, 16, torch.float16),
    (6, 2, 128, 32, torch.bfloat16),
    (8, 1, 64, 32, torch.bfloat16),
    (2, 2, 128, 32, torch.float32),
    (3, 1, 64, 16, torch.bfloat16),
    (16, 2, 128, 16, torch.float32),
]


def run_kernel(batch, scale, **kwargs):
    meta = batch.meta
    return paged_attention(batch.query, batch.key_cache, batch.value_cache, meta.block_tables,
                           meta.seq_lens, meta.query_start_loc, meta.max_query_len, scale,
                           out=poisoned_like(batch.query), **kwargs)


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", SHAPES,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_kernel_matches_reference(batch_name, num_heads, num_kv_heads, head_dim, block_size,
                                  dtype):
    batch = make_batch(BATCHES[batch_name], num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=block_size, dtype=dtype, shared_blocks=1,
                       seed=head_dim + num_heads)
    scale = 1 / math.sqrt(head_dim)
    assert_matches_reference(run_kernel(batch, scale), batch, scale)


def test_long_prefill_spans_several_query_tiles_and_small_kv_tiles():
    """50 new tokens at GQA 3 take three 21-token query tiles; a 16-token KV step is half of a
    32-token block."""
    batch = make_batch([(30, 50), (3, 1)], num_heads=6, num_kv_heads=2, head_dim=64,
                       block_size=32, dtype=torch.float16, shared_blocks=0, seed=7)
    assert_matches_reference(run_kernel(batch, 0.125, tile_n=16), batch, 0.125)


def test_backend_writes_then_attends_like_the_reference():
    """The Triton backend chosen by name, as the model calls it: write the new tokens' keys and
    values into a cache that lacks them, then attend with queries that are a strided view of a
    fused projection."""
    batch = make_batch(BATCHES["mixed"], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                       dtype=torch.float16, shared_blocks=1, seed=3)
    meta = batch.meta
    new_keys = torch.cat([k[-n:] for k, n in zip(batch.keys, meta.query_lens_cpu)])
    new_values = torch.cat([v[-n:] for v, n in zip(batch.values, meta.query_lens_cpu)])
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    key_cache.flatten(0, 1)[meta.slot_mapping] = float("nan")
    value_cache.flatten(0, 1)[meta.slot_mapping] = float("nan")

    backend = select_backend("triton", torch.device("cpu"))
    assert backend.name == "triton"
    backend.write_kv(new_keys, new_values, key_cache, value_cache, meta.slot_mapping)
    torch.testing.assert_close(key_cache, batch.key_cache, equal_nan=True, atol=0, rtol=0)
    fused = torch.cat([batch.query, torch.zeros_like(batch.query[:, :3])], dim=1)
    query = fused[:, :9]
    assert not query.is_contiguous()
    out = backend.attend(query, key_cache, value_cache, meta, 0.125)
    assert_matches_reference(out, batch, 0.125)


def test_empty_batch_returns_empty_output():
    batch = make_batch([(5, 1)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16)
    meta = batch.meta
    empty = batch.query[:0]
    out = paged_attention(empty, batch.key_cache, batch.value_cache, meta.block_tables[:0],
                          meta.seq_lens[:0], meta.query_start_loc[:1], 0, 0.125)
    assert out.shape == (0, 2, 64)


@pytest.mark.parametrize("change,error", [
    (dict(block_tables=lambda t: t.long()), TypeError),
    (dict(query=lambda q: q[:, :, :32].contiguous()), ValueError),        # head_dim 32 vs 64
    (dict(query=lambda q: torch.cat([q, q[:, :1]], dim=1)), ValueError),  # 5 heads over 2
    (dict(value_cache=lambda c: c[:-1]), ValueError),
    (dict(tile_n=lambda n: 24), ValueError),
    (dict(key_cache=lambda c: c.to(torch.int8)), TypeError),
])
def test_bad_inputs_raise_clear_errors(change, error):
    batch = make_batch([(5, 2)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    meta = batch.meta
    args = dict(query=batch.query, key_cache=batch.key_cache, value_cache=batch.value_cache,
                block_tables=meta.block_tables, seq_lens=meta.seq_lens,
                query_start_loc=meta.query_start_loc, max_query_len=2, scale=0.125, tile_n=64)
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises(error):
        paged_attention(**args)

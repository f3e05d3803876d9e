"""The Triton cache writer against the PyTorch reference writer."""

import pytest
import torch

from services.worker.attention.torch_paged import TorchPagedAttention
from services.worker.attention.triton.write_kv import write_kv


def poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("num_kv_heads,head_dim,block_size,dtype", [
    (3, 64, 16, torch.float16), (1, 128, 32, torch.bfloat16), (8, 128, 16, torch.float32)])
def test_write_kv_matches_reference(num_kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, num_tokens = 6, 11
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]  # scattered
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    expected = poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    TorchPagedAttention().write_kv(key, value, *expected, slots)
    got = poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    write_kv(key, value, *got, slots)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, equal_nan=True, atol=0, rtol=0)


def test_write_kv_reads_strided_views_and_skips_padding_slots():
    """Keys and values sliced out of a fused qkv projection; slot -1 marks a padding token."""
    num_tokens, num_kv_heads, head_dim = 4, 2, 64
    qkv = torch.randn(num_tokens, 4 * num_kv_heads, head_dim, dtype=torch.float16)
    key, value = qkv[:, 2 * num_kv_heads:3 * num_kv_heads], qkv[:, 3 * num_kv_heads:]
    slots = torch.tensor([5, -1, 17, 0])
    key_cache, value_cache = poisoned_caches(2, 16, num_kv_heads, head_dim, torch.float16)
    write_kv(key, value, key_cache, value_cache, slots)
    flat_k, flat_v = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    for token, slot in ((0, 5), (2, 17), (3, 0)):
        assert torch.equal(flat_k[slot], key[token]) and torch.equal(flat_v[slot], value[token])
    written = torch.zeros(32, dtype=torch.bool)
    written[[5, 17, 0]] = True
    assert torch.isnan(flat_k[~written]).all() and torch.isnan(flat_v[~written]).all()


@pytest.mark.parametrize("key_shape,slots_len", [((3, 2, 32), 3), ((3, 2, 64), 2)])
def test_write_kv_rejects_mismatched_shapes(key_shape, slots_len):
    key = torch.zeros(key_shape)
    key_cache, value_cache = poisoned_caches(2, 16, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="shapes"):
        write_kv(key, key, key_cache, value_cache, torch.zeros(slots_len, dtype=torch.int64))

"""The split-KV Triton path (segments of the context in parallel, then a merge) against the
PyTorch reference, and the choice of how many segments to cut."""

import pytest
import torch

from services.worker.attention.triton.backend import TritonPagedAttention
from services.worker.attention.triton.split_kv import (
    MAX_SPLITS, MIN_SPLIT_TOKENS, choose_num_splits, split_kv_attention)
from tests.worker.paged_batches import assert_matches_reference, make_batch, poisoned_like

# The interpreter turns a loop bound held in a tensor into an int in a way NumPy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

LONG_DECODE = [(300, 1), (129, 1), (2, 1)]      # the short one leaves most segments empty
LONG_VERIFY = [(290, 3), (77, 3)]


@pytest.mark.parametrize("seqs,num_splits,num_heads,num_kv_heads,head_dim,block_size,dtype", [
    (LONG_DECODE, 4, 8, 1, 128, 16, torch.float16),
    (LONG_DECODE, 3, 9, 3, 64, 32, torch.float32),     # a split count that is not a power of 2
    (LONG_VERIFY, 2, 4, 4, 64, 16, torch.bfloat16),
    (LONG_VERIFY, 16, 6, 2, 128, 32, torch.float16),   # more segments than 64-token steps
], ids=["decode-gqa8", "decode-gqa3-3splits", "verify-gqa1-bf16", "verify-16splits"])
def test_split_kv_matches_reference(seqs, num_splits, num_heads, num_kv_heads, head_dim,
                                    block_size, dtype):
    batch = make_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, shared_blocks=2, seed=num_splits)
    meta = batch.meta
    scale = head_dim ** -0.5
    out = split_kv_attention(batch.query, batch.key_cache, batch.value_cache, meta.block_tables,
                             meta.seq_lens, meta.query_start_loc, meta.max_query_len, scale,
                             num_splits, out=poisoned_like(batch.query))
    assert_matches_reference(out, batch, scale)


def test_backend_splits_small_long_batches_and_matches_reference():
    backend = TritonPagedAttention(num_sms=8)
    batch = make_batch(LONG_DECODE, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.float16, shared_blocks=1)
    assert backend.num_splits(batch.meta, num_kv_heads=2, device=torch.device("cpu")) == 1
    # 300 tokens hold a single segment of MIN_SPLIT_TOKENS; a longer context gets more.
    batch = make_batch([(600, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.float16)
    assert backend.num_splits(batch.meta, num_kv_heads=2, device=torch.device("cpu")) == 2
    assert_matches_reference(backend.attend(batch.query, batch.key_cache, batch.value_cache,
                                            batch.meta, 0.125), batch, 0.125)


@pytest.mark.parametrize("num_seqs,num_kv_heads,max_seq_len,num_sms,expected", [
    (1, 8, 16384, 132, 33),           # Llama-3-8B at batch 1: ~2 programs per SM
    (1, 8, 1024, 132, 1024 // MIN_SPLIT_TOKENS),
    (4, 8, 100_000, 132, 9),
    (1, 1, 10**6, 1024, MAX_SPLITS),
    (17, 8, 16384, 132, 1),           # already fills the GPU
    (1, 8, MIN_SPLIT_TOKENS - 1, 132, 1),
])
def test_choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms, expected):
    assert choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms) == expected


def test_backend_never_splits_long_queries():
    backend = TritonPagedAttention(num_sms=1000)
    batch = make_batch([(600, 9)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16)
    assert backend.num_splits(batch.meta, num_kv_heads=1, device=torch.device("cpu")) == 1


def test_bad_split_count_raises():
    batch = make_batch([(5, 1)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16)
    meta = batch.meta
    with pytest.raises(ValueError, match="num_splits"):
        split_kv_attention(batch.query, batch.key_cache, batch.value_cache, meta.block_tables,
                           meta.seq_lens, meta.query_start_loc, 1, 0.125, num_splits=0)

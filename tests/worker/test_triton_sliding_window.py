"""Sliding-window attention in the Triton kernels (unified and split-KV) against the PyTorch
reference, under the Triton interpreter on CPU. Windows smaller and larger than the contexts,
window starts on and off block edges, prefill chunks whose rows' windows start in different
blocks, and blocks wholly before every window poisoned with NaN (they may have gone back to the
pool), so a kernel that reads them fails."""

import pytest
import torch

from services.worker.attention.triton.backend import TritonPagedAttention
from services.worker.attention.triton.paged_attention import paged_attention
from services.worker.attention.triton.split_kv import split_kv_attention
from tests.worker.paged_batches import (
    assert_matches_reference, make_batch, poison_blocks_before_window, poisoned_like)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

MIXED = [(37, 1), (0, 17), (20, 13), (90, 1), (40, 4), (47, 3)]   # decode, prefill, chunk, verify
CHUNKS = [(50, 40), (64, 16)]                                    # several query tiles per chunk


def _args(batch):
    m = batch.meta
    return (batch.query, batch.key_cache, batch.value_cache, m.block_tables, m.seq_lens,
            m.query_start_loc, m.max_query_len)


@pytest.mark.parametrize("seqs,window,dtype", [
    (MIXED, 16, torch.float32),     # window = block size: starts on block edges
    (MIXED, 5, torch.float16),      # smaller than a block
    (MIXED, 33, torch.float32),
    (MIXED, 1000, torch.float16),   # wider than every context: the same as no window
    (CHUNKS, 24, torch.float16),    # rows of one chunk start their windows in different blocks
    (CHUNKS, 1, torch.float32),     # each row sees itself only
], ids=["w16", "w5-fp16", "w33", "w1000-fp16", "chunks-w24", "chunks-w1"])
def test_paged_attention_sliding_window_matches_reference(seqs, window, dtype):
    batch = make_batch(seqs, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
                       seed=window)
    if window < 100:
        assert poison_blocks_before_window(batch, window) > 0
    scale = 0.125
    out = paged_attention(*_args(batch), scale, out=poisoned_like(batch.query), tile_n=16,
                          window=window)
    assert_matches_reference(out, batch, scale, window)


@pytest.mark.parametrize("num_splits,window", [(3, 100), (4, 250), (2, 7)])
def test_split_kv_sliding_window_matches_reference(num_splits, window):
    """Segments cut the window, not the whole context; a short window leaves segments empty."""
    batch = make_batch([(300, 1), (129, 1), (2, 1), (250, 3)], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=16, dtype=torch.float16, seed=num_splits)
    assert poison_blocks_before_window(batch, window) > 0
    out = split_kv_attention(*_args(batch), 0.125, num_splits, out=poisoned_like(batch.query),
                             tile_n=16, window=window)
    assert_matches_reference(out, batch, 0.125, window)


def test_backend_mixes_sliding_and_global_layers_and_splits_by_window():
    backend = TritonPagedAttention(num_sms=8)
    batch = make_batch([(700, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.float16)
    cpu = torch.device("cpu")
    assert backend.num_splits(batch.meta, 2, cpu) == 2
    assert backend.num_splits(batch.meta, 2, cpu, window=128) == 1   # the window is short
    args = (batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.125)
    assert_matches_reference(backend.attend(*args), batch, 0.125)
    assert_matches_reference(backend.attend(*args, window=128), batch, 0.125, 128)


@pytest.mark.parametrize("window", [0, -1])
def test_bad_window_raises(window):
    batch = make_batch([(5, 1)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16)
    with pytest.raises(ValueError, match="sliding window"):
        paged_attention(*_args(batch), 0.125, window=window)


@pytest.mark.slow
@pytest.mark.parametrize("window", [1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 127, 128])
@pytest.mark.parametrize("tile_n", [16, 64])
def test_window_sweep_on_and_off_block_and_tile_edges(window, tile_n):
    batch = make_batch(MIXED + CHUNKS, num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
                       dtype=torch.float32, seed=window + tile_n)
    poison_blocks_before_window(batch, window)
    out = paged_attention(*_args(batch), 0.125, out=poisoned_like(batch.query), tile_n=tile_n,
                          window=window)
    assert_matches_reference(out, batch, 0.125, window)
    split = split_kv_attention(*_args(batch), 0.125, 3, out=poisoned_like(batch.query),
                               tile_n=tile_n, window=window)
    assert_matches_reference(split, batch, 0.125, window)

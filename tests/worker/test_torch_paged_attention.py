"""The PyTorch paged-attention reference, and the CPU backend (its C kernel for short query rows),
against naive dense causal attention computed from each sequence's own keys and values (never
from the cache), in float64."""

import math

import pytest
import torch

from services.worker.attention.cpu import kernel
from services.worker.attention.cpu.backend import CpuPagedAttention
from services.worker.attention.torch_paged import TorchPagedAttention
from tests.worker.paged_batches import make_batch, poisoned_like


def dense_causal_attention(batch, scale: float, window: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence, query j of a sequence at position seq_len - q_len + j
    seeing positions <= its own (with a window W, the W positions ending at its own, as
    transformers' sliding-window mask kv_idx > q_idx - W); kv head of query head h is
    h // (num_heads / num_kv_heads)."""
    meta = batch.meta
    num_heads = batch.query.shape[1]
    group = num_heads // batch.keys[0].shape[1]
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    row = 0
    for keys, values, q_len, seq_len in zip(batch.keys, batch.values, meta.query_lens_cpu,
                                            meta.seq_lens_cpu):
        for j in range(q_len):
            visible = seq_len - q_len + j + 1
            first = 0 if window is None else max(0, visible - window)
            for h in range(num_heads):
                q = batch.query[row + j, h].double()
                k = keys[first:visible, h // group].double()
                v = values[first:visible, h // group].double()
                out[row + j, h] = torch.softmax(k @ q * scale, dim=0) @ v
        row += q_len
    return out


def cpu_backend() -> CpuPagedAttention:
    """The CPU backend with its kernel built (the test machines have a C compiler: no fallback)."""
    paged_kernel = kernel.load()
    assert paged_kernel is not None, "the CPU paged-attention kernel did not build"
    return CpuPagedAttention(paged_kernel)


BACKENDS = {"torch": TorchPagedAttention, "cpu": cpu_backend}

CASES = {
    # (cached, new) per sequence
    "decode": [(15, 1), (32, 1), (0, 1), (47, 1)],
    # lengths spread widely: decode rows fall into the capped number of length groups
    "decode_spread": [(150, 1), (2, 1), (44, 1), (8, 1), (90, 1), (0, 1), (20, 1)],
    "prefill": [(0, 9), (0, 33)],
    "mixed": [(37, 1), (0, 17), (20, 13), (50, 1), (40, 4)],  # decode, prefill, chunk, verify
    "verify": [(45, 4), (12, 4), (31, 4)],
    # short prompts and chunks batched like verification rows, beside a decode
    "short": [(0, 5), (3, 5), (0, 1), (60, 5), (17, 8)],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 4, 16), (9, 3, 32), (8, 1, 16)])
def test_reference_matches_dense_attention(backend, case, num_heads, num_kv_heads, block_size):
    batch = make_batch(CASES[case], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16,
                       block_size=block_size, shared_blocks=1, seed=len(case) + num_heads)
    scale = 1 / math.sqrt(16)
    out = BACKENDS[backend]().attend(batch.query, batch.key_cache, batch.value_cache,
                                     batch.meta, scale)
    expected = dense_causal_attention(batch, scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reference_ignores_garbage_past_each_sequence(backend):
    """Unused slots hold NaN (make_batch); a decode batch of unequal lengths pads its gather with
    them, and they must not leak into the result."""
    batch = make_batch([(3, 1), (40, 1)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16)
    assert torch.isnan(batch.key_cache).any()
    out = BACKENDS[backend]().attend(batch.query, batch.key_cache, batch.value_cache,
                                       batch.meta, 0.25)
    assert not torch.isnan(out).any()
    # float32 arithmetic against a float64 reference: the CPU kernel is built for the machine
    # (-march=native), and its sums round differently where it vectorises differently.
    torch.testing.assert_close(out.double(), dense_causal_attention(batch, 0.25), atol=1e-5, rtol=1e-5)


def test_reference_write_kv_fills_the_mapped_slots_only():
    batch = make_batch([(5, 3), (16, 2)], num_heads=2, num_kv_heads=2, head_dim=16, block_size=16)
    key_cache = poisoned_like(batch.key_cache)
    value_cache = poisoned_like(batch.value_cache)
    new_keys = torch.cat([k[-n:] for k, n in zip(batch.keys, batch.meta.query_lens_cpu)])
    new_values = torch.cat([v[-n:] for v, n in zip(batch.values, batch.meta.query_lens_cpu)])
    TorchPagedAttention().write_kv(new_keys, new_values, key_cache, value_cache,
                                   batch.meta.slot_mapping)
    flat_k = key_cache.flatten(0, 1)
    flat_v = value_cache.flatten(0, 1)
    torch.testing.assert_close(flat_k[batch.meta.slot_mapping], new_keys)
    torch.testing.assert_close(flat_v[batch.meta.slot_mapping], new_values)
    assert torch.isnan(flat_k).flatten(1).all(1).sum() == flat_k.shape[0] - len(new_keys)


def test_batches_scatter_blocks_and_share_the_prefix():
    """The batches above exercise what they claim: shared prefix blocks, blocks out of order,
    NaN in the unused tail of a partially filled last block."""
    batch = make_batch(CASES["mixed"], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16,
                       shared_blocks=1)
    tables, lens = batch.meta.block_tables, batch.meta.seq_lens_cpu
    sharing = [s for s, (cached, _) in enumerate(CASES["mixed"]) if cached >= 16]
    assert len(sharing) >= 3 and len({int(tables[s, 0]) for s in sharing}) == 1
    own = [int(b) for s, n in enumerate(lens) for b in tables[s, 1:-(-n // 16)]]
    assert own != sorted(own) and len(own) == len(set(own))
    last = tables[0, lens[0] // 16]
    assert torch.isnan(batch.key_cache[last, lens[0] % 16:]).all()


def test_decode_rows_are_grouped_by_similar_length_up_to_a_cap():
    batch = make_batch(CASES["decode_spread"], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16)
    TorchPagedAttention().attend(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.25)
    groups = batch.meta.plans[("torch", None)].groups
    lens = batch.meta.seq_lens_cpu
    assert len(groups) == 4
    assert sorted(int(r) for rows, *_ in groups for r in rows) == list(range(len(lens)))
    firsts = [lens[int(rows[0])] for rows, *_ in groups]
    assert firsts == sorted(firsts)   # each group holds a run of the sorted lengths


# (cached, new) per sequence around a window: contexts shorter, equal to and longer than it,
# prefill chunks whose rows' windows start in different blocks, windows ending on block edges.
WINDOW_CASES = {
    "decode": [(15, 1), (16, 1), (0, 1), (47, 1), (100, 1), (31, 1)],
    "prefill": [(0, 40), (0, 9)],
    "chunk": [(50, 20), (33, 12), (64, 16)],
    "mixed": [(37, 1), (0, 17), (20, 13), (90, 1), (40, 4), (47, 3)],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", WINDOW_CASES)
@pytest.mark.parametrize("window", [1, 5, 16, 17, 32, 200])
def test_reference_sliding_window_matches_dense_attention(backend, case, window):
    batch = make_batch(WINDOW_CASES[case], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                       shared_blocks=1, seed=window)
    out = BACKENDS[backend]().attend(batch.query, batch.key_cache, batch.value_cache,
                                       batch.meta, 0.25, window=window)
    torch.testing.assert_close(out.double(), dense_causal_attention(batch, 0.25, window),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_sliding_and_global_layers_share_one_metadata(name):
    """Gemma 3 interleaves windowed and global layers over one pass's metadata: each keeps its own
    plan, and a window wider than every context is the same as none."""
    batch = make_batch(WINDOW_CASES["mixed"], num_heads=4, num_kv_heads=2, head_dim=16,
                       block_size=16, seed=1)
    backend = BACKENDS[name]()
    args = (batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.25)
    for _ in range(2):
        local, full = backend.attend(*args, window=8), backend.attend(*args)
        torch.testing.assert_close(local.double(), dense_causal_attention(batch, 0.25, 8),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(full.double(), dense_causal_attention(batch, 0.25),
                                   atol=1e-5, rtol=1e-5)
    assert set(batch.meta.plans) == {(name, 8), (name, None)}
    torch.testing.assert_close(backend.attend(*args, window=10**6), full)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_never_reads_blocks_before_the_window(backend):
    """A block wholly before the window of a sequence's first query row may have gone back to the
    pool and hold anything: poison it and the result must not change."""
    batch = make_batch([(70, 1), (40, 9)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16)
    tables = batch.meta.block_tables
    for s, first_block in ((0, 70 - 20 + 1), (1, 40 - 20 + 1)):
        for b in range(first_block // 16):
            batch.key_cache[tables[s, b]] = float("nan")
            batch.value_cache[tables[s, b]] = float("nan")
    out = BACKENDS[backend]().attend(batch.query, batch.key_cache, batch.value_cache,
                                     batch.meta, 0.25, window=20)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), dense_causal_attention(batch, 0.25, 20),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [0, -3, 2.5])
def test_bad_window_raises(backend, window):
    batch = make_batch([(5, 1)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match="sliding window"):
        BACKENDS[backend]().attend(batch.query, batch.key_cache, batch.value_cache, batch.meta,
                                   0.25, window=window)

"""The CPU backend's C kernel where the shared reference tests (test_torch_paged_attention.py) do
not reach: real head sizes and groups, contexts of many chunks, bfloat16, a query that is a view
into the fused QKV projection, the layers it hands to the reference, and the fallback without a
compiler."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.attention.backend import select_backend
from services.worker.attention.cpu import kernel
from services.worker.attention.cpu.backend import CpuPagedAttention
from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.torch_paged import TorchPagedAttention
from tests.worker.paged_batches import make_batch
from tests.worker.test_torch_paged_attention import cpu_backend, dense_causal_attention

# (cached, new): decodes past several of the kernel's 32-position chunks, a verification, a prefill
LONG = [(300, 1), (31, 1), (32, 1), (0, 1), (129, 4), (70, 20)]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (8, 1, 256), (16, 16, 64),
                                                            (6, 2, 72), (4, 4, 5)])
def test_kernel_matches_dense_attention_at_model_sizes(num_heads, num_kv_heads, head_dim):
    """SmolLM2's 9/3 x 64, Qwen3's 32/8 x 128, Gemma's head 256 with one KV head, no grouping; and
    heads that are no multiple of the kernel's 16 partial sums (72, 5)."""
    batch = make_batch(LONG, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=16, shared_blocks=2, seed=head_dim)
    scale = 1 / math.sqrt(head_dim)
    out = cpu_backend().attend(batch.query, batch.key_cache, batch.value_cache, batch.meta, scale)
    torch.testing.assert_close(out.double(), dense_causal_attention(batch, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_bfloat16_layers_are_attended_in_float32_and_rounded_once(num_heads, num_kv_heads, head_dim):
    """bfloat16 query and caches: the kernel serves them (not the reference) and is as close to
    exact attention over those bfloat16 values as one rounding of the output to bfloat16 allows."""
    batch = make_batch(LONG, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=16, dtype=torch.bfloat16, seed=head_dim)
    scale = 1 / math.sqrt(head_dim)
    out = cpu_backend().attend(batch.query, batch.key_cache, batch.value_cache, batch.meta, scale)
    assert out.dtype == torch.bfloat16 and ("cpu", None) in batch.meta.plans
    exact = dense_causal_attention(batch, scale)
    short = torch.tensor([r for r in range(out.shape[0]) if r < sum(batch.meta.query_lens_cpu[:-1])])
    torch.testing.assert_close(out[short].double(), exact[short], atol=1e-6, rtol=2 ** -8)   # the kernel's rows
    torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=2e-2)   # the prefill, on the reference


def test_scores_far_below_the_maximum_weigh_nothing():
    """Scores 100 and more below a row's maximum (past the exponential's range, clamped in the
    kernel without a branch) weigh nothing, and the others still sum to one."""
    batch = make_batch([(40, 1), (100, 1)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16, seed=3)
    batch.query.mul_(60)   # |scores| in the hundreds: most of a row's e^(s - max) underflow
    out = cpu_backend().attend(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense_causal_attention(batch, 0.25), atol=1e-5, rtol=1e-5)


def test_bfloat16_nan_in_a_visible_value_stays_in_its_heads():
    """A NaN value in a visible slot comes out NaN in the query heads of its KV head, and no other
    head or row sees it."""
    batch = make_batch([(20, 1), (20, 1)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                       dtype=torch.bfloat16)
    first_block = int(batch.meta.block_tables[0, 0])
    batch.value_cache[first_block, 3, 0, 5] = float("nan")
    out = cpu_backend().attend(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.25)
    assert out[0, :2, 5].isnan().all() and not out[0, 2:].isnan().any()   # KV head 0 serves query heads 0-1
    assert not out[1].isnan().any()


def test_query_may_be_a_view_into_the_fused_projection():
    """The model slices q out of one QKV matmul: rows further apart than their heads."""
    batch = make_batch([(40, 1), (7, 1)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    fused = torch.cat([batch.query.flatten(1), torch.randn(batch.query.shape[0], 2 * 2 * 16)], dim=1)
    query = fused[:, :4 * 16].view(-1, 4, 16)
    assert not query.is_contiguous()
    out = cpu_backend().attend(query, batch.key_cache, batch.value_cache, batch.meta, 0.25)
    torch.testing.assert_close(out.double(), dense_causal_attention(batch, 0.25), atol=1e-5, rtol=1e-5)


def test_decode_rows_do_not_depend_on_the_batch():
    """Each row is computed alone: a sequence decoded beside others gives the bits it gives alone."""
    batch = make_batch([(90, 1), (13, 1), (200, 1)], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    m = batch.meta
    first_only = AttentionMetadata(m.query_start_loc[:2], m.seq_lens[:1], m.block_tables[:1], m.slot_mapping[:1],
                                   1, m.seq_lens_cpu[0], m.block_size, m.query_lens_cpu[:1], m.seq_lens_cpu[:1])
    backend = cpu_backend()
    together = backend.attend(batch.query, batch.key_cache, batch.value_cache, m, 0.125)
    alone = backend.attend(batch.query[:1], batch.key_cache, batch.value_cache, first_only, 0.125)
    assert torch.equal(together[:1], alone)


@pytest.mark.parametrize("reason", ["float16", "group", "head_dim"])
def test_layers_past_the_kernel_take_the_reference(reason):
    num_heads, num_kv_heads, head_dim, dtype = 4, 2, 16, torch.float32
    if reason == "float16":
        dtype = torch.float16
    elif reason == "group":
        num_heads, num_kv_heads = 34, 2   # 17 query heads per KV head: past MAX_GROUP
    else:
        head_dim = 520                    # past MAX_HEAD_DIM
    batch = make_batch([(20, 1), (3, 1)], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=16, dtype=dtype)
    backend = cpu_backend()
    out = backend.attend(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.25)
    assert set(batch.meta.plans) == {("torch", None)}   # the reference planned it, not the kernel
    expected = TorchPagedAttention().attend(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.25)
    torch.testing.assert_close(out, expected)


def test_auto_picks_the_cpu_backend_with_its_kernel():
    backend = select_backend("auto", torch.device("cpu"))
    assert backend.name == "cpu" and backend.kernel is not None


def test_without_a_compiler_the_backend_is_the_reference(monkeypatch, tmp_path, caplog):
    caplog.set_level("INFO", logger=kernel.__name__)
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernel.load.cache_clear()
    try:
        backend = CpuPagedAttention()
        assert backend.kernel is None
        assert "no C compiler 'no-such-compiler'" in caplog.text
        batch = make_batch([(20, 1), (0, 5)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
        out = backend.attend(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.25)
        torch.testing.assert_close(out.double(), dense_causal_attention(batch, 0.25), atol=1e-5, rtol=1e-5)
    finally:
        kernel.load.cache_clear()


def test_a_failed_build_is_reported_and_leaves_no_library(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(kernel, "SOURCE", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernel.load.cache_clear()
    try:
        assert kernel.load() is None
        assert "failed" in caplog.text
        assert not list((tmp_path / "llmserve" / "kernels").glob("*.so"))
    finally:
        kernel.load.cache_clear()

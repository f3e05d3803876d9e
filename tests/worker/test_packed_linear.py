"""Linear weights packed in oneDNN's layout (CPU serving): the same products and logits as the
plain model, the dense weights gone, and models the packed kernels do not serve left alone."""

from __future__ import annotations

import pytest
import torch

from services.worker.attention.torch_paged import TorchPagedAttention
from services.worker.cpu_features import flag_set
from services.worker.model.layers import Linear
from services.worker.model.loader import load_model
from services.worker.model.packed_linear import PackedLinear, pack_linears

CPU = torch.device("cpu")
# bfloat16 products differ from the plain ones in the order of their sums alone.
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _load(dtype: torch.dtype, pack: bool):
    return load_model("random:tiny", dtype, CPU, TorchPagedAttention(), seed=3, pack_weights=pack)


def _packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of `dtype` on this CPU: float32 everywhere; bfloat16 (x86)
    with AVX-512 BW, VL and DQ or AVX-NE-CONVERT, as its reorder says when it refuses (a Zen 3 VM
    with AVX2 alone, 12-07)."""
    flags = flag_set()
    return dtype == torch.float32 or {b"avx512bw", b"avx512vl", b"avx512dq"} <= flags or b"avx_ne_convert" in flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_model_gives_the_plain_ones_logits_without_its_dense_weights(paged_sequence, dtype, caplog):
    """Where oneDNN cannot pack the dtype, the model keeps its linears, says so once, and still
    gives the plain logits."""
    plain, packed = _load(dtype, False), _load(dtype, True)
    linears = sum(isinstance(m, Linear) for m in plain.model.modules())
    assert linears > 0
    if _packs(dtype):
        assert sum(isinstance(m, PackedLinear) for m in packed.model.modules()) == linears
        assert not any(isinstance(m, Linear) for m in packed.model.modules())
        assert not any(name.endswith("weight_t") for name, _ in packed.model.named_parameters())
    else:
        assert not any(isinstance(m, PackedLinear) for m in packed.model.modules())
        assert sum(isinstance(m, Linear) for m in packed.model.modules()) == linears
        assert "linear weights stay unpacked" in caplog.text
    # The tied head's embedding stays, and the weights a decode step reads are counted the same.
    assert torch.equal(packed.model.embed_tokens.weight, plain.model.embed_tokens.weight)
    assert packed.model.decode_weight_bytes() == plain.model.decode_weight_bytes()
    ids = plain.tokenizer.encode("packed once, at load, for every product")
    want, got = paged_sequence(plain.model).step(ids), paged_sequence(packed.model).step(ids)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_a_packed_linear_with_a_bias_matches_the_plain_product_at_any_batch(rows):
    gen = torch.Generator().manual_seed(rows)
    linear = Linear(48, 80, True, torch.float32, CPU)
    with torch.no_grad():
        linear.weight_t.copy_(torch.randn(48, 80, generator=gen))
        linear.bias.copy_(torch.randn(80, generator=gen))
    x = torch.randn(rows, 48, generator=gen)
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-4, atol=1e-4)


def test_a_model_the_packed_kernels_do_not_serve_keeps_its_linears():
    half = load_model("random:tiny", torch.float16, CPU, TorchPagedAttention(), seed=3)
    assert pack_linears(half.model) == 0
    assert any(isinstance(m, Linear) for m in half.model.modules())
    int8 = load_model("random:tiny", torch.float32, CPU, TorchPagedAttention(), seed=3, quantization="int8",
                      pack_weights=True)
    assert not any(isinstance(m, PackedLinear) for m in int8.model.modules())

"""The fused Triton kernels (RMSNorm with residual add, rotary embedding, SiLU-and-multiply)
against their PyTorch references, and the references against the math they stand for."""

import pytest
import torch

from services.worker.attention.triton.rms_norm import (
    add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference)
from services.worker.attention.triton.rotary import apply_rotary, apply_rotary_reference
from services.worker.attention.triton.silu_mul import silu_and_mul, silu_and_mul_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Both compute in fp32 and round once; the interpreter truncates fp32 -> bf16 where a GPU rounds
# to nearest, so bf16 results may be two units in the last place apart (2^-6).
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype):
    x = randn(3, 5, 576, dtype=dtype)  # SmolLM2's hidden size: not a power of two
    weight = randn(576, dtype=dtype, seed=1)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_reference(dtype):
    x, residual = randn(7, 576, dtype=dtype), randn(7, 576, dtype=dtype, seed=1)
    weight = randn(576, dtype=dtype, seed=2)
    normed, summed = add_rms_norm(x, residual, weight, 1e-5)
    expected_normed, expected_summed = add_rms_norm_reference(x, residual, weight, 1e-5)
    # Exact, but for bfloat16 under the interpreter, which truncates fp32 -> bf16 (a GPU rounds).
    one_ulp = dict(atol=0, rtol=2 ** -7) if dtype == torch.bfloat16 else dict(atol=0, rtol=0)
    torch.testing.assert_close(summed, expected_summed, **one_ulp)
    torch.testing.assert_close(normed, expected_normed, **TOLERANCE[dtype])


def test_rms_norm_reference_is_unit_rms_times_weight():
    x = randn(4, 64, dtype=torch.float32)
    weight = randn(64, dtype=torch.float32, seed=1)
    y = rms_norm_reference(x, weight, 0.0) / weight
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(4))
    torch.testing.assert_close(y * x.pow(2).mean(-1, keepdim=True).sqrt(), x)


def rotary_tables(max_positions, head_dim, theta):
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_matches_reference_on_a_strided_view(dtype, head_dim):
    """Queries and keys rotated together as a slice of one fused qkv projection, as the model
    does it."""
    num_tokens, num_heads, num_kv_heads = 5, 9, 3
    qkv = randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
    qk = qkv[:, :num_heads + num_kv_heads]
    positions = torch.tensor([0, 7, 8, 100, 3])
    cos, sin = rotary_tables(128, head_dim, theta=100000.0)
    torch.testing.assert_close(apply_rotary(qk, positions, cos, sin),
                               apply_rotary_reference(qk, positions, cos, sin), **TOLERANCE[dtype])


def test_rotary_scores_depend_only_on_relative_position():
    """<R(p) q, R(s) k> = <R(p + d) q, R(s + d) k>, and position 0 is the identity."""
    cos, sin = rotary_tables(64, 64, theta=10000.0)
    q, k = randn(1, 1, 64, dtype=torch.float32), randn(1, 1, 64, dtype=torch.float32, seed=1)
    rotate = lambda x, p: apply_rotary_reference(x, torch.tensor([p]), cos, sin)  # noqa: E731
    score = lambda p, s: (rotate(q, p) * rotate(k, s)).sum()  # noqa: E731
    torch.testing.assert_close(score(9, 4), score(30, 25))
    assert not torch.isclose(score(9, 4), score(9, 5))
    torch.testing.assert_close(rotate(q, 0), q)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    x = randn(2, 3, 2 * 1536, dtype=dtype)  # SmolLM2's ffn: 1.5 blocks of 1024 per row
    out = silu_and_mul(x)
    assert out.shape == (2, 3, 1536)
    torch.testing.assert_close(out, silu_and_mul_reference(x), **TOLERANCE[dtype])


def test_silu_and_mul_reference_is_gate_silu_times_up():
    x = torch.tensor([[1.0, -2.0, 3.0, 4.0]])
    expected = torch.tensor([[1.0 / (1 + torch.e ** -1) * 3.0, -2.0 / (1 + torch.e ** 2) * 4.0]])
    torch.testing.assert_close(silu_and_mul_reference(x), expected)


def test_fused_kernels_reject_bad_shapes():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-5)
    cos, sin = rotary_tables(8, 64, 10000.0)
    with pytest.raises(ValueError, match="cos and sin"):
        apply_rotary(torch.zeros(1, 2, 128), torch.zeros(1, dtype=torch.long), cos, sin)
    with pytest.raises(ValueError, match="one position per token"):
        apply_rotary(torch.zeros(2, 2, 64), torch.zeros(3, dtype=torch.long), cos, sin)

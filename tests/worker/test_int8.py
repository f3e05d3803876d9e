"""Int8 weights on the CPU: accuracy at the level of the weights' own rounding, results that do not
depend on the batch, and the engine serving SmolLM2 with them."""

from __future__ import annotations

import copy

import pytest
import torch

from services.worker.attention.torch_paged import TorchPagedAttention
from services.worker.model.int8_linear import Int8Linear, quantize_int8
from services.worker.model.layers import Linear
from services.worker.model.loader import load_model
from tests.worker.test_engine import CHAT_PROMPTS, LONG_TEXT, chat_ids, greedy, make_engine, run


def float_linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    linear = Linear(in_features, out_features, bias, torch.float32, torch.device("cpu"))
    linear.weight_t.data = torch.randn(in_features, out_features, generator=g) * 0.05
    if bias:
        linear.bias.data = torch.randn(out_features, generator=g)
    return linear


def activations(rows: int, features: int, seed: int = 1) -> torch.Tensor:
    """LLM-like rows: a few outlier channels ~12x the rest, as SmolLM2's hidden states have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=g)
    x[:, [3, 17, 40]] *= 12
    return x


def int8_reference(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    """x times the int8-rounded weights in float: what int8 weights alone cost."""
    w = linear.weight_t.detach().t()
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    return x @ (torch.round(w / scale) * scale).t() + (0 if linear.bias is None else linear.bias)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("bias", [False, True])
def test_activations_cost_almost_nothing_beyond_the_weights_rounding(bias):
    linear = float_linear(96, 160, bias)
    x = activations(7, 96)
    y = Int8Linear(linear)(x)
    with torch.no_grad():
        exact = linear(x)
        weights_only = int8_reference(linear, x)
    # The activations are carried at ~13 bits: the result is the int8 weights' result to 1e-3,
    # while one 7-bit pass would be off by several percent with these outliers.
    assert relative_error(y, weights_only) < 2e-3
    assert relative_error(y, exact) < 2e-2


def test_a_rows_result_does_not_depend_on_the_batch():
    q = Int8Linear(float_linear(64, 48, bias=True))
    x = activations(5, 64)
    x[2] *= 1000                      # a huge row beside ordinary ones
    x[4, 0] = -x[4].abs().max() * 3   # and a row whose extreme is negative
    batch = q(x)
    for i in range(len(x)):
        assert torch.equal(q(x[i:i + 1])[0], batch[i])


def test_zero_rows_and_empty_batches():
    q = Int8Linear(float_linear(32, 16, bias=False))
    assert torch.equal(q(torch.zeros(2, 32)), torch.zeros(2, 16))
    assert q(torch.zeros(0, 32)).shape == (0, 16)


def test_only_cpu_float32_models_are_quantized():
    linear = float_linear(8, 8, bias=False).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        quantize_int8(linear)


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        load_model("random:tiny", torch.float32, torch.device("cpu"), TorchPagedAttention(), quantization="int4")


@pytest.fixture(scope="module")
def smollm2_int8(smollm2):
    model = quantize_int8(copy.deepcopy(smollm2.model))
    return type(smollm2)(config=smollm2.config, model=model, tokenizer=smollm2.tokenizer)


def test_every_linear_is_int8_and_a_decode_step_reads_a_quarter_of_the_bytes(smollm2, smollm2_int8):
    assert not any(isinstance(m, Linear) for m in smollm2_int8.model.modules())
    ratio = smollm2_int8.model.decode_weight_bytes() / smollm2.model.decode_weight_bytes()
    assert 0.25 <= ratio < 0.27


def test_engine_serves_int8_smollm2_batch_invariant_and_returns_every_block(smollm2_int8):
    tokenizer = smollm2_int8.tokenizer
    requests = {f"c{i}": (chat_ids(tokenizer, p), greedy(24)) for i, p in enumerate(CHAT_PROMPTS)}
    requests["long"] = (tokenizer.encode(LONG_TEXT)[:200], greedy(16))
    engine = make_engine(smollm2_int8, max_num_batched_tokens=64)
    start = engine.pool.num_free_blocks
    batch = run(engine, requests)
    assert engine.pool.num_free_blocks == start
    for rid in ("c0", "long"):
        alone = run(make_engine(smollm2_int8), {rid: requests[rid]})
        assert alone[rid].tokens == batch[rid].tokens
    assert "Paris" in batch["c0"].text

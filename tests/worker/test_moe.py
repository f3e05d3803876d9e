"""Mixture-of-experts layers: routing, the grouping of rows by expert, the PyTorch path against a
per-token dense reference and transformers' own Mixtral / Qwen3-MoE blocks, and the Triton
grouped-GEMM path against the PyTorch one (under the Triton interpreter on CPU): expert counts
4-64, top-k 1-8, empty experts, a single token, uneven groups, renormalisation on and off."""

import pytest
import torch
import torch.nn.functional as F

from services.worker.moe.backend import select_moe_backend
from services.worker.moe.routing import group_by_expert, group_capacity, route
from services.worker.moe.torch_moe import TorchFusedMoE
from services.worker.moe.triton_moe import TritonFusedMoE, choose_block_m

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def make_layer(tokens, hidden, intermediate, experts, dtype=torch.float32, seed=0, skew=0.0):
    """Random inputs of one MoE layer; skew > 0 pushes the router towards the low experts, so
    groups are uneven and the high experts get no rows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen) - skew * torch.arange(experts)
    w_gate_up = torch.randn(experts, 2 * intermediate, hidden, generator=gen) / hidden ** 0.5
    w_down = torch.randn(experts, hidden, intermediate, generator=gen) / intermediate ** 0.5
    return [t.to(dtype) for t in (x, logits, w_gate_up, w_down)]


def dense_moe(x, logits, w_gate_up, w_down, top_k, renormalize, activation="silu"):
    """Token by token, in float64: softmax, top-k, optional renormalisation, weighted sum of
    down(silu(gate x) * up x) over the chosen experts."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    intermediate = w_down.shape[2]
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), dim=0)
        weights, experts = torch.topk(probs, top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, experts):
            gate_up = w_gate_up[e].double() @ x[t].double()
            gate = gate_up[:intermediate]
            act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
            h = act * gate_up[intermediate:]
            out[t] += w * (w_down[e].double() @ h)
    return out


def test_route_softmax_topk_and_renormalisation():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    plain = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert plain.experts[0].tolist() == [0, 2] and plain.experts[1, 0] == 2   # row 1's second: a tie
    torch.testing.assert_close(plain.weights[0], probs[0, [0, 2]])
    normed = route(logits, 2, renormalize=True)
    torch.testing.assert_close(normed.weights.sum(-1), torch.ones(2))
    torch.testing.assert_close(normed.weights[0], probs[0, [0, 2]] / probs[0, [0, 2]].sum())
    assert normed.weights.dtype == torch.float32


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(1, 1, 4, 16), (13, 3, 8, 16),
                                                           (40, 8, 64, 16), (100, 2, 4, 64)])
def test_group_by_expert_puts_every_row_once_in_blocks_of_one_expert(tokens, top_k, experts, block_m):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    groups = group_by_expert(ids, experts, block_m)
    num_rows = tokens * top_k
    assert groups.rows.shape == (group_capacity(num_rows, experts, block_m),)
    rows = groups.rows.view(-1, block_m)
    real = rows < num_rows
    assert sorted(rows[real].tolist()) == list(range(num_rows))
    flat = ids.flatten()
    for block, expert in enumerate(groups.block_expert.tolist()):
        if expert < 0:
            assert not real[block].any()
        else:
            assert real[block, 0] and (flat[rows[block][real[block]].long()] == expert).all()
    # Groups come in expert order, each padded only at its end.
    used = groups.block_expert[groups.block_expert >= 0]
    assert (used.diff() >= 0).all() and set(used.tolist()) == set(flat.tolist())


CASES = {
    # name: (tokens, hidden, intermediate, experts, top_k, renormalize, skew)
    "single-token-top1": (1, 32, 16, 4, 1, False, 0.0),
    "mixtral-like": (9, 32, 48, 8, 2, True, 0.0),
    "qwen3-moe-like": (12, 64, 16, 64, 8, False, 0.0),
    "empty-and-uneven": (20, 32, 16, 16, 4, True, 0.6),   # experts past ~8 get nothing
    "all-on-few-experts": (33, 32, 32, 32, 2, False, 5.0),  # groups > block_m rows and empty ones
    "top8-of-8": (5, 16, 16, 8, 8, True, 0.0),
}


@pytest.mark.parametrize("case", CASES)
def test_torch_path_matches_dense_reference(case):
    tokens, hidden, intermediate, experts, top_k, renormalize, skew = CASES[case]
    x, logits, w_gate_up, w_down = make_layer(tokens, hidden, intermediate, experts, skew=skew)
    out = TorchFusedMoE()(x, logits, w_gate_up, w_down, top_k, renormalize)
    torch.testing.assert_close(out.double(), dense_moe(x, logits, w_gate_up, w_down, top_k, renormalize),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_path_matches_torch_path(case, dtype):
    tokens, hidden, intermediate, experts, top_k, renormalize, skew = CASES[case]
    x, logits, w_gate_up, w_down = make_layer(tokens, hidden, intermediate, experts, dtype, skew=skew)
    if skew:
        used = route(logits, top_k, renormalize).experts.unique()
        assert len(used) < experts                      # some experts really are empty
    out = TritonFusedMoE(block_n=16)(x, logits, w_gate_up, w_down, top_k, renormalize)
    assert out.dtype == dtype and out.shape == x.shape
    expected = TorchFusedMoE()(*(t.float() for t in (x, logits, w_gate_up, w_down)), top_k, renormalize)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(out.float(), expected, **tol)


@pytest.mark.parametrize("backend", [TorchFusedMoE(), TritonFusedMoE(block_n=16)], ids=lambda b: b.name)
def test_gelu_tanh_experts_match_dense_reference(backend):
    x, logits, w_gate_up, w_down = make_layer(6, 32, 16, 8, seed=5)
    out = backend(x, logits, w_gate_up, w_down, 2, False, activation="gelu_tanh")
    expected = dense_moe(x, logits, w_gate_up, w_down, 2, False, "gelu_tanh")
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    silu = dense_moe(x, logits, w_gate_up, w_down, 2, False)
    assert (expected - silu).abs().max() > 1e-2      # the activation really differs


def test_triton_path_with_blocks_of_64_rows_and_strided_hidden():
    """A prefill-sized batch takes 64-row blocks; hidden may be a row-strided view."""
    x, logits, w_gate_up, w_down = make_layer(70, 32, 16, 4, seed=3)
    assert choose_block_m(70 * 2, 4) == 64
    wide = torch.cat([x, torch.zeros_like(x)], dim=1)[:, :32]
    out = TritonFusedMoE(block_n=16)(wide, logits, w_gate_up, w_down, 2, True)
    torch.testing.assert_close(out, TorchFusedMoE()(x, logits, w_gate_up, w_down, 2, True),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_torch_path_matches_transformers_sparse_moe_block(family):
    """transformers 5's own blocks with their router: Mixtral renormalises the top-k weights,
    Qwen3-MoE does so only with norm_topk_prob (both settings checked)."""
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    variants = [("mixtral", True, dict(num_local_experts=8, intermediate_size=24))] if family == "mixtral" \
        else [("qwen3_moe", norm, dict(num_experts=16, moe_intermediate_size=24, norm_topk_prob=norm))
              for norm in (False, True)]
    for model_type, renormalize, kw in variants:
        cfg = AutoConfig.for_model(model_type, hidden_size=32, num_experts_per_tok=2, **kw)
        block = (MixtralSparseMoeBlock if family == "mixtral" else Qwen3MoeSparseMoeBlock)(cfg).eval()
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.3)
        x = torch.randn(7, 32)
        with torch.no_grad():
            expected = block(x[None])[0]
            ours = TorchFusedMoE()(x, x @ block.gate.weight.T, block.experts.gate_up_proj,
                                   block.experts.down_proj, 2, renormalize)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_select_moe_backend():
    cpu = torch.device("cpu")
    assert select_moe_backend("auto", cpu).name == "torch"
    assert select_moe_backend("cpu", cpu).name == "torch"   # the CPU attention backend's MoE
    assert select_moe_backend("triton", cpu).name == "triton"
    with pytest.raises(ValueError, match="unknown MoE backend"):
        select_moe_backend("cutlass", cpu)


def test_empty_batch():
    x, logits, w_gate_up, w_down = make_layer(0, 16, 16, 4)
    for backend in (TorchFusedMoE(), TritonFusedMoE()):
        assert backend(x, logits, w_gate_up, w_down, 2, True).shape == (0, 16)


@pytest.mark.parametrize("change,match", [
    (dict(top_k=0), "top_k"),
    (dict(top_k=5), "top_k"),
    (dict(w_down=lambda w: w[:, :, :8]), "w_down"),
    (dict(w_gate_up=lambda w: w[:, :15]), "w_gate_up"),
    (dict(router_logits=lambda r: r[:, :3]), "router_logits"),
    (dict(hidden=lambda h: h[None]), "hidden"),
    (dict(activation="relu"), "activation"),
])
@pytest.mark.parametrize("backend", [TorchFusedMoE(), TritonFusedMoE()], ids=lambda b: b.name)
def test_bad_arguments_raise_clear_errors(change, match, backend):
    x, logits, w_gate_up, w_down = make_layer(3, 16, 16, 4)
    args = dict(hidden=x, router_logits=logits, w_gate_up=w_gate_up, w_down=w_down, top_k=2,
                renormalize=True, activation="silu")
    for name, value in change.items():
        args[name] = value(args[name]) if callable(value) else value
    with pytest.raises(ValueError, match=match):
        backend(**args)


@pytest.mark.slow
@pytest.mark.parametrize("experts,top_k", [(e, k) for e in (4, 8, 16, 32, 64) for k in (1, 2, 4, 8) if k <= e])
@pytest.mark.parametrize("renormalize", [False, True])
def test_triton_sweep_of_experts_and_top_k(experts, top_k, renormalize):
    for tokens, skew in ((1, 0.0), (17, 0.0), (40, 1.0)):
        x, logits, w_gate_up, w_down = make_layer(tokens, 32, 16, experts, torch.float16,
                                                  seed=experts * top_k + tokens, skew=skew)
        out = TritonFusedMoE()(x, logits, w_gate_up, w_down, top_k, renormalize)
        expected = TorchFusedMoE()(*(t.float() for t in (x, logits, w_gate_up, w_down)), top_k, renormalize)
        torch.testing.assert_close(out.float(), expected, atol=5e-3, rtol=5e-3)

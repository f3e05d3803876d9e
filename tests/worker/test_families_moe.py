"""Mixture-of-experts families from their Hugging Face folders against transformers, token for token.

qwen3_moe (softmax top-k weights as they are, and renormalised; a dense layer beside the sparse
ones) and mixtral (renormalised top-k, sliding window): tiny random checkpoints built and saved by
transformers 5, which writes the experts one by one (mlp.experts.N.gate_proj / block_sparse_moe.
experts.N.w1, ...); also read with the experts stacked as transformers 5 holds them, from a
config.json in the 4.x layout, and Qwen3-MoE served by a real worker process over gRPC.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.worker.families import (WINDOW, build_family, check_4x_layout, check_engine, check_worker, load,
                                   to_4x_layout)

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
CASES = {
    "qwen3_moe": ("qwen3_moe", dict(MOE, norm_topk_prob=False, mlp_only_layers=[1], head_dim=32)),
    "qwen3_moe-renormalised": ("qwen3_moe", dict(MOE, norm_topk_prob=True)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
}


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory, smollm2_tokenizer):
    """-> (case, folder, transformers' greedy references per prompt)."""
    return build_family(request.param, CASES, tmp_path_factory, smollm2_tokenizer)


def test_the_config_is_read_as_written(family):
    case, folder, _ = family
    c = load(folder).config
    assert c.num_experts == (4 if case == "mixtral" else 8) and c.num_experts_per_tok == 2
    assert c.moe_renormalize == (case != "qwen3_moe")
    assert c.dense_layers == ((1,) if case == "qwen3_moe" else ())
    assert c.sliding_window == (WINDOW if case == "mixtral" else None)
    assert c.moe_intermediate_size == (96 if case == "mixtral" else 32)


def test_engine_matches_transformers_under_every_setting(family):
    check_engine(load(family[1]), family[2])


def test_config_in_the_4x_layout_gives_the_same_model(family, tmp_path):
    check_4x_layout(*family[1:], tmp_path)


def test_stacked_experts_load_as_the_per_expert_ones(family, tmp_path):
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I],
    the router at mlp.gate) as a checkpoint: the same parameters."""
    case, folder, _ = family
    stacked = to_4x_layout(folder, tmp_path / "stacked")   # symlinks; the weights file is replaced
    tensors = load_file(folder / "model.safetensors")
    prefix = "block_sparse_moe" if case == "mixtral" else "mlp"
    gate, up, down = ("w1", "w3", "w2") if case == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out, experts = {}, {}
    for name, t in tensors.items():
        parts = name.split(".")
        if f".{prefix}.experts." in name:
            layer, e, proj = parts[2], int(parts[5]), parts[6]
            experts.setdefault(layer, {}).setdefault(proj, {})[e] = t
        else:
            out[name.replace(f".{prefix}.gate.", ".mlp.gate.")] = t
    for layer, projs in experts.items():
        n = len(projs[gate])
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([projs[gate][e], projs[up][e]]) for e in range(n)])
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([projs[down][e] for e in range(n)])
    (stacked / "model.safetensors").unlink()
    save_file(out, stacked / "model.safetensors")
    ours, theirs = dict(load(stacked).model.named_parameters()), dict(load(folder).model.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_missing_expert_is_named(family, tmp_path):
    case, folder, _ = family
    broken = to_4x_layout(folder, tmp_path / "broken")
    name = ("model.layers.0.block_sparse_moe.experts.3.w3.weight" if case == "mixtral"
            else "model.layers.0.mlp.experts.5.up_proj.weight")
    tensors = {k: v for k, v in load_file(folder / "model.safetensors").items() if k != name}
    (broken / "model.safetensors").unlink()
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=f"broken: checkpoint lacks 1 tensors, e.g. {name}"):
        load(broken)


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
def test_qwen3_moe_served_by_a_worker_over_grpc(family, tmp_path):
    _, folder, references = family
    check_worker(tmp_path, folder, references)

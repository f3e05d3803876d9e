"""The attention backends plan once per step, not once per layer: the launch checks, grid and
split count of the Triton kernels (the PyTorch reference's gather plan, the CPU kernel's rows) are built by the first
layer that needs them and kept in the step's metadata for every other layer of the same shape."""

from __future__ import annotations

import pytest
import torch

import services.worker.attention.cpu.backend as cpu_backend
import services.worker.attention.torch_paged as torch_paged
import services.worker.attention.triton.backend as triton_backend
from services.worker.attention.cpu.backend import CpuPagedAttention
from services.worker.attention.torch_paged import TorchPagedAttention
from services.worker.attention.triton.backend import TritonPagedAttention
from services.worker.engine.model_runner import SeqSpan, forward_pass, kv_cache_tensors
from services.worker.model.loader import load_model

CPU = torch.device("cpu")
BLOCK = 16


@pytest.mark.parametrize("backend, module, name", [
    (TritonPagedAttention, triton_backend, "launch_config"),
    (TorchPagedAttention, torch_paged, "GroupPlan"),
    (CpuPagedAttention, cpu_backend, "RowPlan"),
])
def test_one_plan_per_step_whatever_the_number_of_layers(backend, module, name, monkeypatch):
    loaded = load_model("random:tiny", torch.float32, CPU, backend())
    cfg = loaded.model.config
    assert cfg.num_layers >= 2
    planned = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: planned.append(1) or original(*a, **k))
    caches = kv_cache_tensors(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, BLOCK, torch.float32, CPU)
    spans = [SeqSpan([5, 6, 7], 0, [1]), SeqSpan([9], 20, [2, 3])]
    for step in range(2):
        forward_pass(loaded.model, caches, spans, BLOCK, CPU)
        assert len(planned) == step + 1      # one per step, not one per layer

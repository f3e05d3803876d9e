"""The families whose GPU path differs (sliding-window attention, fused MoE) through the Triton
backends, under the interpreter on the CPU: the same tokens as the PyTorch path, under batching,
prefix caching and the second, cached pass. Slow (the interpreter): make test-soak."""

from __future__ import annotations

import pytest
import torch

from services.worker.attention.triton.backend import TritonPagedAttention
from services.worker.model.loader import load_model
from tests.worker import test_families, test_families_moe
from tests.worker.families import build_family, engine_outputs, load, prompts

CASES = {"gemma3_text": test_families.CASES["gemma3_text"], "mixtral": test_families_moe.CASES["mixtral"],
         "qwen3_moe": test_families_moe.CASES["qwen3_moe"]}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_triton_path_gives_the_pytorch_paths_tokens(case, tmp_path_factory, smollm2_tokenizer):
    _, folder, _ = build_family(case, CASES, tmp_path_factory, smollm2_tokenizer)
    triton = load_model(str(folder), torch.float32, torch.device("cpu"), TritonPagedAttention(num_sms=64))
    ours, _ = engine_outputs(triton, prompts(), attention_backend="triton")
    reference, _ = engine_outputs(load(folder), prompts())
    assert ours == reference

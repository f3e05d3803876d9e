"""Shared, expensive worker-test objects (session scoped) and a paged greedy-decoding helper.

The reference is transformers loading the very same GGUF (float32, eval); ours is loaded through
services.worker.model.loader. Both dequantise to float32, so they should agree to float rounding.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch

from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.torch_paged import TorchPagedAttention
from services.worker.model.gguf_loader import smollm2_gguf_path as _smollm2_gguf_path
from services.worker.model.llama import LlamaModel
from services.worker.model.loader import LoadedModel, load_model
from services.worker.model.loader import smollm2_tokenizer as _smollm2_tokenizer
from services.worker.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    return _smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Tokenizer:
    """SmolLM2's tokenizer alone (no weights); the same object random:<shape> models use."""
    return _smollm2_tokenizer()


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """Our SmolLM2-135M-Instruct: float32, PyTorch attention backend, CPU."""
    return load_model("smollm2", torch.float32, torch.device("cpu"), TorchPagedAttention())


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf_path):
    from transformers import AutoTokenizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path):
    """transformers' LlamaForCausalLM from the same GGUF, float32, eval."""
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name,
                                                     torch_dtype=torch.float32)
    return model.eval()


@dataclass
class PagedSequence:
    """One sequence laid into its own paged KV cache with the trivial block table 0, 1, 2, ..."""

    model: LlamaModel
    max_tokens: int = 512
    block_size: int = 16

    def __post_init__(self):
        c = self.model.config
        num_blocks = -(-self.max_tokens // self.block_size)
        param = next(self.model.parameters())
        shape = (num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=param.dtype, device=param.device),
                           torch.zeros(shape, dtype=param.dtype, device=param.device)) for _ in range(c.num_layers)]
        self.block_table = torch.arange(num_blocks, dtype=torch.int32, device=param.device)[None, :]
        self.length = 0

    def step(self, new_ids: list[int]) -> torch.Tensor:
        """Run the model over the next tokens of the sequence; -> float32 logits of each new token."""
        device = self.block_table.device
        start, end = self.length, self.length + len(new_ids)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, len(new_ids)], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
            block_tables=self.block_table,
            slot_mapping=torch.arange(start, end, dtype=torch.int64, device=device),
            max_query_len=len(new_ids), max_seq_len=end, block_size=self.block_size,
            query_lens_cpu=[len(new_ids)], seq_lens_cpu=[end])
        hidden = self.model(torch.tensor(new_ids, device=device), torch.arange(start, end, device=device),
                            self.kv_caches, meta)
        self.length = end
        return self.model.compute_logits(hidden)


def paged_greedy(model: LlamaModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Prefill the prompt, then decode one token at a time through the paged cache, greedily."""
    seq = PagedSequence(model, max_tokens=len(prompt_ids) + max_new_tokens)
    next_id = int(seq.step(prompt_ids)[-1].argmax())
    out = [next_id]
    while len(out) < max_new_tokens:
        next_id = int(seq.step([next_id])[-1].argmax())
        out.append(next_id)
    return out


@pytest.fixture(scope="session", name="paged_greedy")
def paged_greedy_fixture():
    """paged_greedy(model, prompt_ids, max_new_tokens) -> generated ids (no stop on EOS)."""
    return paged_greedy


@pytest.fixture(scope="session")
def paged_sequence():
    """PagedSequence(model, max_tokens=512, block_size=16); .step(new_ids) -> logits of the new tokens."""
    return PagedSequence

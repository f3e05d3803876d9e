"""Our SmolLM2 (GGUF -> fused Llama over the paged cache) against transformers on the same GGUF.

Both dequantise the same weights to float32; the remaining differences are float32 rounding of
differently fused and ordered operations, so logits agree to LOGITS_ATOL (they reach about 40).
"""

from __future__ import annotations

import pytest
import torch

LOGITS_ATOL = 1e-3

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "Once upon a time, in a land far, far away, there lived a",
    "Translate to French: I like green apples. 🍏",
]

CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain recursion to a five-year-old.",
    "List three prime numbers.",
    "What is 12 times 12?",
    "Give me a Python one-liner that reverses a string.",
    "Who wrote Romeo and Juliet?",
    "Describe the color blue without using the word blue.",
]


def _reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def test_config_from_gguf(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta, c.max_context_length) == (1536, 49152, 100000.0, 8192)
    assert c.tie_word_embeddings
    assert torch.equal(smollm2.model.lm_head.weight_t, smollm2.model.embed_tokens.weight.t())
    assert c.bos_token_id == 1 and c.eos_token_ids == [2]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_logits_match_transformers(smollm2, hf_smollm2, paged_sequence, prompt):
    ids = smollm2.tokenizer.encode(prompt)
    ours = paged_sequence(smollm2.model).step(ids)
    reference = _reference_logits(hf_smollm2, ids)
    assert ours.dtype == torch.float32 and ours.shape == reference.shape
    torch.testing.assert_close(ours, reference, atol=LOGITS_ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_chunked_prefill_and_decode_match_one_pass(smollm2, hf_smollm2, paged_sequence):
    """Feeding the prompt in chunks (16-token blocks straddled) and then single tokens gives the same logits."""
    ids = smollm2.tokenizer.encode(PROMPTS[2] + " " + PROMPTS[1])
    seq = paged_sequence(smollm2.model)
    chunks = [seq.step(ids[:7]), seq.step(ids[7:25])] + [seq.step([i]) for i in ids[25:]]
    torch.testing.assert_close(torch.cat(chunks), _reference_logits(hf_smollm2, ids), atol=LOGITS_ATOL, rtol=0)


def test_greedy_32_tokens_match_transformers_generate(smollm2, hf_smollm2, hf_smollm2_tokenizer, paged_greedy):
    """Ours: each chat alone, prefill then 31 single-token decode steps through the paged cache.
    transformers: all eight in one left-padded greedy generate (it stops a row at EOS; we do not)."""
    tok = smollm2.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in CHATS]
    width = max(len(ids) for ids in prompts)
    pad = hf_smollm2_tokenizer.pad_token_id or 0
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    with torch.no_grad():
        generated = hf_smollm2.generate(input_ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                                        pad_token_id=pad)[:, width:].tolist()
    for question, ids, reference in zip(CHATS, prompts, generated):
        ours = paged_greedy(smollm2.model, ids, 32)
        if tok.eos_token_ids[0] in reference:
            reference = reference[:reference.index(tok.eos_token_ids[0]) + 1]
        assert ours[:len(reference)] == reference, (question, tok.decode(ours), tok.decode(reference))

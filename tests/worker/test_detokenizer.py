"""Incremental detokenization: deltas never split a character and add up to the full decode."""

from __future__ import annotations

import random

import pytest

from services.worker.model.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Rocket 🚀 fire 🔥 thumbs 👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵!",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트。",
    "Ünïcödé ŝtŕíñĝš, math ∑∫√∞ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
]


def _stream(tokenizer, ids, chunk, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[1, 2, 3], skip_special_tokens=skip_special_tokens)
    deltas = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok.finish()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_join_to_decode_without_replacement_chars(smollm2_tokenizer, text, chunk):
    ids = smollm2_tokenizer.encode(text)
    assert any("\ufffd" in smollm2_tokenizer.token_text(i) for i in ids)  # some tokens hold partial characters
    deltas, tail = _stream(smollm2_tokenizer, ids, chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + tail == smollm2_tokenizer.decode(ids) == text
    assert tail == ""


def test_special_tokens_skipped_or_kept(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("Hi<|im_end|>\n<|im_start|>")
    deltas, _ = _stream(smollm2_tokenizer, ids, 1)
    assert "".join(deltas) == "Hi\n" == smollm2_tokenizer.decode(ids)
    deltas, _ = _stream(smollm2_tokenizer, ids, 1, skip_special_tokens=False)
    assert "".join(deltas) == "Hi<|im_end|>\n<|im_start|>" == smollm2_tokenizer.decode(ids, skip_special_tokens=False)


def test_invalid_and_cut_off_bytes_decode_like_the_tokenizer(smollm2_tokenizer):
    """Random single-byte tokens (mostly invalid UTF-8): deltas + finish() equal decode()."""
    byte_tokens = [i for i in range(smollm2_tokenizer.vocab_size) if len(smollm2_tokenizer.token_bytes(i)) == 1]
    assert len(byte_tokens) > 200  # every byte that can occur in UTF-8 text
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.choice(byte_tokens) for _ in range(rng.randint(1, 12))]
        deltas, tail = _stream(smollm2_tokenizer, ids, rng.randint(1, 3))
        assert "".join(deltas) + tail == smollm2_tokenizer.decode(ids)
    cut_off = smollm2_tokenizer.encode("ok 🚀")[:-1]   # the rocket's last byte never arrives
    deltas, tail = _stream(smollm2_tokenizer, cut_off, 1)
    assert "".join(deltas) == "ok " and tail == "\ufffd"
    assert "".join(deltas) + tail == smollm2_tokenizer.decode(cut_off)

"""Random-weight models run without SmolLM2's vocabulary (the GPU benchmark image lacks it)."""

import torch

from services.worker.attention.torch_paged import TorchPagedAttention
from services.worker.model import loader
from services.worker.model.byte_tokenizer import byte_tokenizer
from services.worker.model.detokenizer import IncrementalDetokenizer


def test_any_text_round_trips_and_streams_whole_characters():
    tok = byte_tokenizer()
    text = "héllo wörld 🙂 日本 <tag>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok.vocab_size == 258
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) + detok.finish() == text and not any("\ufffd" in d for d in deltas)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def test_random_model_falls_back_to_bytes_without_smollm2(monkeypatch):
    def missing():
        raise ImportError("no gguf here")
    monkeypatch.setattr(loader, "smollm2_tokenizer", missing)
    loaded = loader.load_model("random:tiny", torch.float32, torch.device("cpu"), TorchPagedAttention())
    assert loaded.tokenizer.vocab_size == 258 and loaded.tokenizer.eos_token_ids == [257]

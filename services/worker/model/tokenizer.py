"""Byte-level BPE tokenizer (SmolLM2, Llama 3, Qwen2) on the `tokenizers` library, with its chat template.

Every token stands for a fixed byte string (`token_bytes`), so decoding a sequence is joining its
tokens' bytes and reading them as UTF-8 (invalid bytes become U+FFFD): the same rule the
library's ByteLevel decoder applies, which the incremental detokenizer relies on.
"""

from __future__ import annotations

import tokenizers

from services.worker.model.chat_template import ChatTemplate


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, bos_token_id: int | None, eos_token_ids: list[int],
                 chat_template: str | None):
        if backend.decoder is None or b'"ByteLevel"' not in backend.decoder.__getstate__():
            raise ValueError("only byte-level BPE tokenizers are supported (SmolLM2, Llama 3, Qwen2 style)")
        self._backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._bytes: dict[int, bytes] = {}   # filled on first use
        special_tokens = {"bos_token": self._token_or_none(bos_token_id),
                          "eos_token": self._token_or_none(eos_token_ids[0] if eos_token_ids else None)}
        special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self._chat_template = ChatTemplate(chat_template, special_tokens) if chat_template else None

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers` object (e.g. to save it as tokenizer.json)."""
        return self._backend

    @property
    def chat_template(self) -> str | None:
        return self._chat_template.source if self._chat_template else None

    def encode(self, text: str) -> list[int]:
        """Token ids of text, adding no special tokens (a rendered chat template carries its own).

        Through encode_batch: unlike encode, it releases the GIL while the Rust tokenizer runs, so
        a huge prompt tokenized in a thread does not stall the caller's event loop."""
        return self._backend.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if self._chat_template is None:
            raise ValueError("this model has no chat template")
        return self._chat_template.render(messages, add_generation_prompt, tools)

    @property
    def tool_call_format(self) -> str:
        """How the model writes tool calls: hermes | llama3_json | mistral (chat_template.py)."""
        return self._chat_template.tool_call_format if self._chat_template else "hermes"

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (b'' for an id outside the vocabulary)."""
        data = self._bytes.get(token_id)
        if data is None:
            data = self._bytes[token_id] = _token_bytes(self._backend.id_to_token(token_id))
        return data

    def token_text(self, token_id: int) -> str:
        """The token's bytes as text; a token holding part of a UTF-8 character shows U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def _token_or_none(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes stand for themselves, the rest are shifted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shift)
            shift += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_UNICODE_TO_BYTE = _gpt2_unicode_to_byte()


def _token_bytes(token: str | None) -> bytes:
    # As the ByteLevel decoder: a token made only of byte-alphabet characters maps to those bytes;
    # any other token (an added token such as "<|reserved special token 0|>") is its own UTF-8 text.
    if token is None:
        return b""
    if all(c in _UNICODE_TO_BYTE for c in token):
        return bytes(_UNICODE_TO_BYTE[c] for c in token)
    return token.encode()

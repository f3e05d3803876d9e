"""Turns a stream of generated token ids into text deltas without ever splitting a character.

Byte-level tokens stand for fixed byte strings, so the text so far is the UTF-8 reading of their
joined bytes. An incremental UTF-8 decoder holds back a character whose bytes have not all
arrived yet (an emoji spread over several tokens) and replaces invalid bytes as decode() does,
so the deltas joined, plus finish(), equal tokenizer.decode(all output ids).
"""

from __future__ import annotations

import codecs

from services.worker.model.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        # prompt_ids are not needed: a byte-level token decodes the same whatever precedes it.
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, new_ids: list[int]) -> str:
        """Text completed by these tokens; bytes of an unfinished character wait for the next push."""
        tok = self._tokenizer
        data = b"".join(tok.token_bytes(i) for i in new_ids
                        if not (self._skip_special_tokens and tok.is_special(i)))
        return self._utf8.decode(data)

    def finish(self) -> str:
        """At the end of the output: the held-back bytes of a cut-off character, as U+FFFD (else '')."""
        return self._utf8.decode(b"", final=True)

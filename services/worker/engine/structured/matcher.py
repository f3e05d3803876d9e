"""One request's position in its grammar, and the token masks that follow from it.

Invariant: the matcher has consumed exactly the request's output tokens (num_tokens ==
len(output_token_ids)). It advances only when the engine appends accepted tokens; draft tokens
are walked through and rolled back. Preemption keeps a request's output tokens (only their keys
and values are recomputed), so the matcher needs no change there.
"""

from __future__ import annotations

import llguidance
import llguidance.torch
import torch

from services.worker.engine.structured.bitmask import bitmask_to_bias, bitmask_words


class GrammarMatcher:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.num_tokens = 0

    def accept(self, token_id: int) -> bool:
        """Consume one accepted token; False if the grammar forbids it (the matcher is then broken)."""
        ok = self._matcher.consume_token(token_id)
        self.num_tokens += ok
        return ok

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error().split("\n<state>")[0] if self._matcher.is_error() else ""

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of token_ids, in order, the grammar allows from here (state unchanged)."""
        return self._matcher.validate_tokens(token_ids) if token_ids else 0

    def masks(self, drafts: list[int]) -> torch.Tensor:
        """Logit biases [len(drafts) + 1, vocab] (0 allowed, -inf not): row j is what may follow drafts[:j].

        Rows after the first draft the grammar refuses allow everything: verification rejects that
        draft at the latest, so they are never sampled from."""
        out = torch.full((len(drafts) + 1, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        self._walk(drafts, out, every_row=True)
        return bitmask_to_bias(out, self.vocab_size)

    def mask_after(self, drafts: list[int]) -> torch.Tensor:
        """Logit bias [vocab] of what may follow drafts (all allowed if the grammar refuses them)."""
        out = torch.full((1, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        self._walk(drafts, out, every_row=False)
        return bitmask_to_bias(out, self.vocab_size)[0]

    def _walk(self, drafts: list[int], out: torch.Tensor, every_row: bool) -> None:
        """Fill out's rows while walking the drafts, then roll the walk back."""
        walked = 0
        for j in range(len(drafts) + 1):
            if every_row or j == len(drafts):
                llguidance.torch.fill_next_token_bitmask(self._matcher, out, j if every_row else 0)
            # A refused token would break the matcher for good: validate before consuming.
            if j == len(drafts) or self._matcher.is_stopped() or not self.valid_prefix(drafts[j:j + 1]):
                break
            self._matcher.consume_token(drafts[j])
            walked += 1
        if walked:
            self._matcher.rollback(walked)

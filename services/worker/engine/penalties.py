"""Logit adjustments that depend on a request's history: penalties and min_tokens.

Both run on the raw logits, before temperature, so greedy requests get them too (as in vLLM).
Token histories are flattened into one tensor per batch and scattered into [rows, vocab] counts:
the work is proportional to the tokens and the batch, never a Python loop over the vocabulary.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from services.worker.engine.sampler import SamplingRow
    from services.worker.engine.sampling_params import SamplingParams


def has_penalties(row: SamplingRow) -> bool:
    return penalised(row.params)


def penalised(p: SamplingParams) -> bool:
    """Whether a request's sampling reads its history for penalties."""
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place on logits [len(rows), V].

    repetition_penalty (HF): every token seen in prompt or output has its logit divided by the
    penalty when positive, multiplied when negative. Then presence / frequency (OpenAI), over the
    output only: logit -= presence * [count > 0] + frequency * count.
    """
    vocab_size = logits.shape[1]
    counts = token_counts([r.output_token_ids for r in rows], vocab_size, logits)

    repetition = _column([r.params.repetition_penalty for r in rows], logits)
    if bool((repetition != 1.0).any()):
        # Only rows with the penalty pay for scattering their prompt.
        prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in rows]
        seen = (counts > 0) | (token_counts(prompts, vocab_size, logits) > 0)
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits.copy_(torch.where(seen, penalised, logits))

    presence = _column([r.params.presence_penalty for r in rows], logits)
    frequency = _column([r.params.frequency_penalty for r in rows], logits)
    logits.sub_(presence * (counts > 0) + frequency * counts)


def suppress_stop_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: a row that has produced fewer than min_tokens cannot pick a stop or EOS token."""
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            stops = set(row.params.stop_token_ids) | set(row.eos_token_ids)
            row_index += [i] * len(stops)
            token_index += stops
    if not row_index:
        return
    vocab_size = logits.shape[1]
    if not all(0 <= t < vocab_size for t in token_index):
        raise ValueError(f"stop and EOS token ids must be in [0, {vocab_size})")
    logits[torch.tensor(row_index, device=logits.device),
           torch.tensor(token_index, device=logits.device)] = float("-inf")


def token_counts(seqs: Sequence[Sequence[int]], vocab_size: int, like: torch.Tensor) -> torch.Tensor:
    """[len(seqs), vocab_size] occurrence counts, dtype and device of `like`."""
    lengths = torch.tensor([len(s) for s in seqs])
    tokens = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {int(tokens.min())}..{int(tokens.max())}")
    row_of_token = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
    counts = torch.zeros(len(seqs), vocab_size, dtype=like.dtype, device=like.device)
    counts.index_put_((row_of_token.to(like.device), tokens.to(like.device)),
                      torch.ones((), dtype=like.dtype, device=like.device), accumulate=True)
    return counts


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]

"""Verifying draft tokens against the target model, one request at a time.

Both functions return the accepted prefix of the draft plus exactly one token from the target
(a correction at the first rejection, or a bonus after the whole draft), so every verification
step makes progress and the output is what the target alone would have produced (greedy) or is
distributed as if it had been sampled from the target alone (speculative sampling).
"""

from __future__ import annotations

import torch

from services.worker.engine.sampler import draw


def verify_greedy(draft_tokens: list[int], target_argmax: list[int]) -> list[int]:
    """target_argmax[i] is the target's choice after the context plus draft_tokens[:i]."""
    if len(target_argmax) != len(draft_tokens) + 1:
        raise ValueError(f"need len(draft_tokens) + 1 = {len(draft_tokens) + 1} target tokens, "
                         f"got {len(target_argmax)}")
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == target_argmax[accepted]:
        accepted += 1
    return draft_tokens[:accepted] + [target_argmax[accepted]]


def rejection_sample(draft_tokens: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator | None) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    target_probs [k+1, V]: the processed target distribution after each draft prefix.
    draft_probs [k, V]: the distributions the drafts were sampled from, or None for a
    deterministic proposer (n-gram), which is a one-hot draft: q(x) = 1.
    Draft x_i is accepted with probability min(1, p(x_i) / q(x_i)); at the first rejection the
    correction is drawn from max(p - q, 0) renormalised (p without x_i for a one-hot draft).
    """
    k = len(draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [len(draft_tokens) + 1 = {k + 1}, vocab], "
                         f"got {list(target_probs.shape)}")
    vocab_size = target_probs.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (k, vocab_size):
        raise ValueError(f"draft_probs must be [{k}, {vocab_size}], got {list(draft_probs.shape)}")
    if not all(0 <= t < vocab_size for t in draft_tokens):
        raise ValueError(f"draft tokens must be in [0, {vocab_size})")
    if k == 0:
        return [int(draw(target_probs[0], generator))]

    device = target_probs.device
    drafts = torch.tensor(draft_tokens, device=device)
    p = target_probs[:k].gather(1, drafts[:, None]).squeeze(1)
    q = draft_probs[:k].gather(1, drafts[:, None]).squeeze(1) if draft_probs is not None else torch.ones_like(p)
    u = torch.rand(k, generator=generator, device=device, dtype=p.dtype)
    accepted = int((u * q < p).cumprod(0).sum())   # u < p / q, without dividing by q = 0
    if accepted == k:
        return draft_tokens + [int(draw(target_probs[k], generator))]

    target = target_probs[accepted]
    if draft_probs is not None:
        residual = (target - draft_probs[accepted]).clamp_min(0.0)
    else:
        residual = target.clone()
        residual[draft_tokens[accepted]] = 0.0
    # Exact arithmetic never rejects when the residual is empty (then p <= q everywhere, so p == q);
    # rounding can, and then p itself is the right distribution.
    residual = torch.where(residual.sum() > 0, residual, target)
    return draft_tokens[:accepted] + [int(draw(residual, generator))]

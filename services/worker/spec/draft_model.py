"""Draft-model speculation: a small model with the target's tokenizer proposes the drafts.

The draft model has its own paged KV cache (its own tensors, with the target's block size and
block count) addressed by the target's block tables and slot mappings. Invariant: it computes
keys and values for exactly the tokens the target computes, so every block a request holds,
prefix-cached and shared ones included, is valid for it too, and neither the scheduler nor the
block pool knows it exists. The one gap is Request.draft_lag: when the target keeps all k
drafts, the k-th was never fed to the draft model, so the next catch-up starts a token earlier.

Each step, after scheduling (which reserved slots for the k drafts) and before the target's pass:
1. one catch-up pass over every scheduled request's known new tokens, speculating or not, so
   the cache stays complete; a speculating request's last row gives its first draft;
2. k-1 single-token passes over the speculating requests, each writing the previous draft into
   its reserved slot. Rejected drafts' slots are void for both models, like the target's.
Drafts are drawn from q, the draft model's distribution after the request's own sampling
settings and grammar mask (greedy: its argmax); q goes to the rejection sampler, which keeps sampling exact.
"""

from __future__ import annotations

import torch

from services.worker.engine.model_runner import Draft, SeqSpan, forward_pass, kv_cache_tensors, sampling_row
from services.worker.engine.sampler import Sampler, exponential_race
from services.worker.engine.scheduler import ScheduledRequest


class DraftModelProposer:
    def __init__(self, model, num_blocks: int, block_size: int, sampler: Sampler) -> None:
        """model: a LlamaModel whose vocabulary is the target's."""
        self.model = model
        self.block_size = block_size
        self.sampler = sampler
        param = next(model.parameters())
        self.device = param.device
        c = model.config
        self.kv_caches = kv_cache_tensors(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size,
                                          param.dtype, param.device)

    @torch.inference_mode()
    def propose(self, batch: list[ScheduledRequest]) -> dict[str, Draft]:
        """Bring the draft cache up to date for the whole batch; -> the drafts of the speculating
        requests, exactly num_spec_tokens each."""
        spans = []
        for item in batch:
            r, begin = item.request, item.start_position - item.request.draft_lag
            spans.append(SeqSpan(r.all_token_ids[begin:item.start_position + item.num_known_tokens], begin,
                                 item.block_ids))
        hidden, ends = forward_pass(self.model, self.kv_caches, spans, self.block_size, self.device)
        active = [item for item in batch if item.num_spec_tokens]
        if not active:
            return {}
        hidden = hidden[torch.tensor([end - 1 for item, end in zip(batch, ends) if item.num_spec_tokens],
                                     device=self.device)]
        tokens = {item.request.request_id: [] for item in active}
        probs = {item.request.request_id: [] for item in active}
        for j in range(max(item.num_spec_tokens for item in active)):
            if j:
                active = [item for item in active if item.num_spec_tokens > j]
                # Draft j (counting from 1) goes in the slot j - 1 after the known tokens.
                spans = [SeqSpan(tokens[item.request.request_id][-1:],
                                 item.start_position + item.num_known_tokens + j - 1, item.block_ids)
                         for item in active]
                hidden, _ = forward_pass(self.model, self.kv_caches, spans, self.block_size, self.device)
            self._draw(active, self.model.compute_logits(hidden), tokens, probs)
        # A greedy request keeps no q: verification compares tokens.
        return {rid: Draft(tokens[rid], torch.stack(probs[rid]) if probs[rid] else None) for rid in tokens}

    def _draw(self, items: list[ScheduledRequest], logits: torch.Tensor, tokens: dict[str, list[int]],
              probs: dict[str, list[torch.Tensor]]) -> None:
        """One more draft per item, drawn from q; q itself is kept for sampled requests."""
        q = self.sampler.probs(logits, [sampling_row(item.request, tokens[item.request.request_id],
                                                     _grammar_mask(item.request, tokens[item.request.request_id]))
                                        for item in items])
        argmax = q.argmax(-1).tolist()   # a greedy row of q is one-hot at the processed argmax
        for i, item in enumerate(items):
            r, rid = item.request, item.request.request_id
            if r.params.greedy:
                tokens[rid].append(argmax[i])
            else:
                tokens[rid].append(int(exponential_race(q[i], r.generator or self.sampler.generator)))
                probs[rid].append(q[i])


def _grammar_mask(request, drafted: list[int]) -> torch.Tensor | None:
    """A constrained request drafts inside its grammar too, or its drafts would mostly be rejected."""
    return None if request.matcher is None else request.matcher.mask_after(drafted)

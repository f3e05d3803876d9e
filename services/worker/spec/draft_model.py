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

from services.worker.engine.input_batch import InputBatch
from services.worker.engine.model_runner import Draft, SeqSpan, forward_pass, kv_cache_tensors
from services.worker.engine.sampler import Sampler, draw
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
    def propose(self, batch: list[ScheduledRequest], rows: list[int], inputs: InputBatch) -> dict[str, Draft]:
        """Bring the draft cache up to date for the whole batch; -> the drafts of the speculating
        requests, exactly num_spec_tokens each. rows: each scheduled request's row of the runner's
        batch (inputs), whose tokens and sampling settings it reads (no live request, but a
        constrained request's grammar matcher)."""
        spans = []
        for item, row in zip(batch, rows):
            begin = item.start_position - item.draft_lag
            spans.append(SeqSpan(inputs.token_ids[row, begin:item.start_position + item.num_known_tokens].tolist(),
                                 begin, item.block_ids))
        hidden, ends = forward_pass(self.model, self.kv_caches, spans, self.block_size, self.device)
        active = [(item, row) for item, row in zip(batch, rows) if item.num_spec_tokens]
        if not active:
            return {}
        hidden = hidden[torch.tensor([end - 1 for item, end in zip(batch, ends) if item.num_spec_tokens],
                                     device=self.device)]
        tokens = {item.request_id: [] for item, _ in active}
        probs = {item.request_id: [] for item, _ in active}
        for j in range(max(item.num_spec_tokens for item, _ in active)):
            if j:
                active = [(item, row) for item, row in active if item.num_spec_tokens > j]
                # Draft j (counting from 1) goes in the slot j - 1 after the known tokens.
                spans = [SeqSpan(tokens[item.request_id][-1:],
                                 item.start_position + item.num_known_tokens + j - 1, item.block_ids)
                         for item, _ in active]
                hidden, _ = forward_pass(self.model, self.kv_caches, spans, self.block_size, self.device)
            self._draw(active, inputs, self.model.compute_logits(hidden), tokens, probs)
        # A greedy request keeps no q: verification compares tokens.
        return {rid: Draft(tokens[rid], torch.stack(probs[rid]) if probs[rid] else None) for rid in tokens}

    def _draw(self, items: list[tuple[ScheduledRequest, int]], inputs: InputBatch, logits: torch.Tensor,
              tokens: dict[str, list[int]], probs: dict[str, list[torch.Tensor]]) -> None:
        """One more draft per item, drawn from q; q itself is kept for sampled requests."""
        rows = [inputs.sampling_row(row, tokens[item.request_id],
                                    _grammar_mask(item, tokens[item.request_id]) if inputs.constrained(row) else None)
                for item, row in items]
        q = self.sampler.probs(logits, rows)
        argmax = q.argmax(-1).tolist()   # a greedy row of q is one-hot at the processed argmax
        for i, ((item, _), row) in enumerate(zip(items, rows)):
            rid = item.request_id
            if row.params.greedy:
                tokens[rid].append(argmax[i])
            else:
                tokens[rid].append(int(draw(q[i], row.generator or self.sampler.generator)))
                probs[rid].append(q[i])


def _grammar_mask(item: ScheduledRequest, drafted: list[int]) -> torch.Tensor:
    """A constrained request drafts inside its grammar too, or its drafts would mostly be rejected."""
    return item.request.matcher.mask_after(drafted)

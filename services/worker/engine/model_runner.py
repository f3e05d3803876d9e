"""Turns a scheduled batch into tensors, runs the model over the paged cache, and samples.

The runner owns the KV cache tensors and never sees the block pool: it gets block ids from
the scheduler's output. Each sequence contributes its new tokens to one flattened batch; the
logits of its last token (or of its k+1 verification positions) are sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention.metadata import AttentionMetadata
from services.worker.engine.sampler import Sampler, SamplingRow
from services.worker.engine.scheduler import ScheduledRequest
from services.worker.spec.rejection import rejection_sample, verify_greedy


@dataclass
class StepResult:
    token_ids: list[int]                                   # 1 token, or the accepted drafts + 1
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_rejected: int = 0                                  # draft tokens whose slots are void


class ModelRunner:
    def __init__(self, model, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, sampler: Sampler) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledRequest]) -> dict[str, StepResult]:
        input_ids, positions, slots, query_lens, seq_lens, sample_rows = [], [], [], [], [], []
        bs = self.block_size
        for item in batch:
            r, start = item.request, item.start_position
            num_known = item.num_new_tokens - item.num_spec_tokens
            tokens = r.all_token_ids[start:start + num_known] + r.spec_token_ids[:item.num_spec_tokens]
            input_ids += tokens
            span = range(start, start + item.num_new_tokens)
            positions += span
            slots += [item.block_ids[p // bs] * bs + p % bs for p in span]
            row_end = len(input_ids)
            if item.samples:
                sample_rows.append(list(range(row_end - item.num_spec_tokens - 1, row_end)))
            query_lens.append(item.num_new_tokens)
            seq_lens.append(start + item.num_new_tokens)
        meta = self._metadata(batch, query_lens, seq_lens, slots)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.kv_caches, meta)
        if not sample_rows:
            return {}
        flat = [row for rows in sample_rows for row in rows]
        logits = self.model.compute_logits(hidden[torch.tensor(flat, device=self.device)])
        return self._sample([b for b in batch if b.samples], logits)

    def _metadata(self, batch, query_lens, seq_lens, slots) -> AttentionMetadata:
        max_blocks = max(len(b.block_ids) for b in batch)
        table = [b.block_ids + [0] * (max_blocks - len(b.block_ids)) for b in batch]   # one tensor, not one per row
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        dev = self.device
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=self.block_size,
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)

    def _sample(self, items: list[ScheduledRequest], logits: torch.Tensor) -> dict[str, StepResult]:
        """Plain rows are sampled together; speculative rows are verified per request."""
        results: dict[str, StepResult] = {}
        plain, plain_rows, offset = [], [], 0
        for item in items:
            k = item.num_spec_tokens
            if k == 0:
                plain.append(item)
                plain_rows.append(offset)
            else:
                results[item.request.request_id] = self._verify(item, logits[offset:offset + k + 1])
            offset += k + 1
        if plain:
            rows = [_sampling_row(item.request) for item in plain]
            out = self.sampler.sample(logits[plain_rows], rows)
            for j, item in enumerate(plain):
                results[item.request.request_id] = StepResult(
                    [out.token_ids[j]],
                    [out.logprobs[j]] if out.logprobs is not None else None,
                    [out.top_logprobs[j]] if out.top_logprobs is not None else None)
        return results

    def _verify(self, item: ScheduledRequest, logits: torch.Tensor) -> StepResult:
        r = item.request
        drafts = r.spec_token_ids[:item.num_spec_tokens]
        # Position j of the k+1 rows follows the drafts before it: penalties must see them.
        rows = [_sampling_row(r, drafts[:j]) for j in range(len(drafts) + 1)]
        if r.params.greedy:
            accepted = verify_greedy(drafts, self.sampler.sample(logits, rows).token_ids)
        else:
            accepted = rejection_sample(drafts, None, self.sampler.probs(logits, rows),
                                        r.generator or self.sampler.generator)
        result = StepResult(accepted, num_rejected=len(drafts) + 1 - len(accepted))
        if r.params.logprobs:
            logprobs = torch.log_softmax(logits[:len(accepted)].float(), dim=-1)
            chosen = torch.tensor(accepted, device=logprobs.device)
            result.logprobs = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
            if r.params.top_logprobs:
                values, indices = logprobs.topk(r.params.top_logprobs, dim=-1)
                result.top_logprobs = [list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
        return result


def _sampling_row(request, extra_output: list[int] = ()) -> SamplingRow:
    output = request.output_token_ids + list(extra_output) if extra_output else request.output_token_ids
    return SamplingRow(params=request.params, prompt_token_ids=request.prompt_token_ids,
                       output_token_ids=output, generator=request.generator,
                       eos_token_ids=() if request.params.ignore_eos else request.eos_token_ids)

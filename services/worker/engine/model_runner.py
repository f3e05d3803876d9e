"""Turns a scheduled batch into tensors, runs the model over the paged cache, and samples.

The runner owns the KV cache tensors and never sees the block pool: it gets block ids from
the scheduler's output. Each sequence contributes its new tokens to one flattened batch; the
logits of its last token (or of its k+1 verification positions) are sampled. With a draft
model (spec/draft_model.py) the drafts are made first, inside the same step; otherwise they
are the n-gram proposer's, already on the request. A constrained request's rows are sampled
under its grammar's masks (StepMasks): drafts outside the grammar are never accepted.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from services.worker.attention.metadata import AttentionMetadata, block_table_array, slot_mapping
from services.worker.engine.decode_graphs import DecodeGraphs
from services.worker.engine.sampler import Sampler, SamplingRow
from services.worker.engine.scheduler import ScheduledRequest
from services.worker.engine.structured.step_masks import StepMasks
from services.worker.spec.rejection import rejection_sample, verify_greedy

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    token_ids: list[int]                                   # 1 token, or the accepted drafts + 1
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_rejected: int = 0                                  # draft tokens whose slots are void
    draft_lag: int = 0                                     # see Request.draft_lag


@dataclass
class Draft:
    """The tokens one request verifies this step, and the distributions they were drawn from:
    probs [k, V], or None for a deterministic proposer (n-gram) or a greedy request."""
    token_ids: list[int]
    probs: torch.Tensor | None = None


class RequestStepError(RuntimeError):
    """A step failed because of these requests alone; the rest of its batch can run again."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"requests {request_ids}: {cause!r}")
        self.request_ids = request_ids


class SeqSpan(NamedTuple):
    """One sequence's new tokens in a forward pass."""
    token_ids: list[int]
    start: int              # position of the first of them
    block_ids: list[int]    # the sequence's block table, covering every position up to the last


def kv_cache_tensors(num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                     dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


@dataclass
class ForwardInputs:
    """Everything one forward pass reads besides the weights and the KV cache, on the device."""
    input_ids: torch.Tensor     # int64 [num tokens]
    positions: torch.Tensor     # int64 [num tokens]
    meta: AttentionMetadata


def prepare_inputs(spans: list[SeqSpan], block_size: int, device: torch.device) -> tuple[ForwardInputs, list[int]]:
    """The spans as one flattened batch: positions and cache slots computed as tensors (no
    per-token Python), each copied to the device once. -> the inputs and each span's end row."""
    n = len(spans)
    query_lens = [len(s.token_ids) for s in spans]
    seq_lens = [s.start + q for s, q in zip(spans, query_lens)]
    ends = list(itertools.accumulate(query_lens))
    ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in spans), np.int64, ends[-1])
    query_start_loc = np.array([0] + ends, np.int32)
    starts = np.fromiter((s.start for s in spans), np.int64, n)
    if ends[-1] == n:   # one token a span (decode): no expansion
        rows, positions = np.arange(n), starts
    else:
        rows = np.repeat(np.arange(n), query_lens)
        positions = starts[rows] + np.arange(ends[-1]) - query_start_loc[:-1].astype(np.int64)[rows]
    table = block_table_array([s.block_ids for s in spans])

    def on_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)
    meta = AttentionMetadata(
        query_start_loc=on_device(query_start_loc), seq_lens=on_device(np.array(seq_lens, np.int32)),
        block_tables=on_device(table), slot_mapping=on_device(slot_mapping(table, rows, positions, block_size)),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=block_size,
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
    return ForwardInputs(on_device(ids), on_device(positions), meta), ends


def forward_pass(model, kv_caches, spans: list[SeqSpan], block_size: int,
                 device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Run model over the spans as one flattened batch, writing their keys and values into their
    slots. -> hidden states [num tokens, hidden] and each span's end row (exclusive)."""
    inputs, ends = prepare_inputs(spans, block_size, device)
    return model(inputs.input_ids, inputs.positions, kv_caches, inputs.meta), ends


class ModelRunner:
    def __init__(self, model, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, sampler: Sampler,
                 drafter=None, max_model_len: int = 0, graph_max_batch: int = 0) -> None:
        """drafter: a DraftModelProposer, or None when drafts (if any) come from the n-gram proposer.
        graph_max_batch: decode steps of up to this many rows run through DecodeGraphs (0: never),
        which needs an attention backend that reads only device tensors (Triton)."""
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.drafter = drafter
        self.kv_caches = kv_cache_tensors(num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device)
        self.decode_graphs = None
        if graph_max_batch:
            graphs = DecodeGraphs(model, self.kv_caches, block_size, max_model_len, graph_max_batch, device)
            try:
                graphs.capture()
                self.decode_graphs = graphs
            except RuntimeError:   # a model or kernel that cannot be captured still serves, eagerly
                log.exception("capturing decode CUDA graphs failed; decode steps run eagerly")

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledRequest], masks: StepMasks | None = None) -> dict[str, StepResult]:
        """masks: the grammar masks of the batch's constrained requests (none: unconstrained).
        Raises RequestStepError when the failure is some requests' own; a failed step leaves the
        seeded generators as they were, so a request run again draws the same numbers."""
        generators = [b.request.generator for b in batch if b.request.generator is not None]
        states = [g.get_state() for g in generators]
        try:
            return self._execute(batch, masks or StepMasks())
        except Exception:
            for g, state in zip(generators, states):
                g.set_state(state)
            raise

    def _execute(self, batch: list[ScheduledRequest], masks: StepMasks) -> dict[str, StepResult]:
        drafts = self._drafts(batch)
        if self._graph_step(batch):
            logits = self.decode_graphs.run([b.request.all_token_ids[b.start_position] for b in batch],
                                            [b.start_position for b in batch], [b.block_ids for b in batch])
            return self._sample(batch, logits, drafts, masks)
        spans = []
        for item in batch:
            r, start = item.request, item.start_position
            tokens = r.all_token_ids[start:start + item.num_known_tokens]
            if item.num_spec_tokens:
                tokens = tokens + drafts[r.request_id].token_ids
            spans.append(SeqSpan(tokens, start, item.block_ids))
        hidden, ends = forward_pass(self.model, self.kv_caches, spans, self.block_size, self.device)
        rows = [row for item, end in zip(batch, ends) if item.samples
                for row in range(end - item.num_spec_tokens - 1, end)]
        if not rows:
            return {}
        if len(rows) < hidden.shape[0]:   # rows ascend, so as many as hidden's are all of them
            hidden = hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(hidden)
        return self._sample([b for b in batch if b.samples], logits, drafts, masks)

    def _graph_step(self, batch: list[ScheduledRequest]) -> bool:
        """A step of plain decode rows only (one known token each, sampled, nothing to verify)."""
        return (self.decode_graphs is not None and self.decode_graphs.fits(len(batch))
                and all(b.num_known_tokens == 1 and not b.num_spec_tokens and b.samples for b in batch))

    def _drafts(self, batch: list[ScheduledRequest]) -> dict[str, Draft]:
        if self.drafter is not None:
            return self.drafter.propose(batch)
        return {b.request.request_id: Draft(b.request.spec_token_ids[:b.num_spec_tokens])
                for b in batch if b.num_spec_tokens}

    def _sample(self, items: list[ScheduledRequest], logits: torch.Tensor,
                drafts: dict[str, Draft], masks: StepMasks) -> dict[str, StepResult]:
        """Plain rows are sampled together; speculative rows are verified per request."""
        results: dict[str, StepResult] = {}
        plain, plain_rows, offset = [], [], 0
        for item in items:
            k = item.num_spec_tokens
            if k == 0:
                plain.append(item)
                plain_rows.append(offset)
            else:
                rid = item.request.request_id
                try:
                    results[rid] = self._verify(item, logits[offset:offset + k + 1], drafts[rid], masks)
                except Exception as error:
                    raise RequestStepError([rid], error) from error
            offset += k + 1
        if plain:
            rows = [sampling_row(item.request, grammar_bias=_first(_masks(item.request, [], masks))) for item in plain]
            plain_logits = logits if len(plain) == logits.shape[0] else logits[plain_rows]   # no copy when all
            try:
                out = self.sampler.sample(plain_logits, rows)
            except Exception as error:
                raise self._blame(plain, plain_logits, rows, error) from error
            for j, item in enumerate(plain):
                results[item.request.request_id] = StepResult(
                    [out.token_ids[j]],
                    [out.logprobs[j]] if out.logprobs is not None else None,
                    [out.top_logprobs[j]] if out.top_logprobs is not None else None)
        return results

    def _blame(self, items: list[ScheduledRequest], logits: torch.Tensor, rows: list[SamplingRow],
               error: Exception) -> RequestStepError:
        """The rows whose sampling fails on their own (all of them, if none does alone)."""
        culprits = []
        for j, item in enumerate(items):
            try:
                self.sampler.sample(logits[j:j + 1], rows[j:j + 1])
            except Exception:
                culprits.append(item.request.request_id)
        return RequestStepError(culprits or [item.request.request_id for item in items], error)

    def _verify(self, item: ScheduledRequest, logits: torch.Tensor, draft: Draft, masks: StepMasks) -> StepResult:
        r, tokens = item.request, draft.token_ids
        # Position j of the k+1 rows follows the drafts before it: penalties and the grammar must see them.
        biases = _masks(r, tokens, masks)
        rows = [sampling_row(r, tokens[:j], None if biases is None else biases[j])
                for j in range(len(tokens) + 1)]
        if r.params.greedy:
            accepted = verify_greedy(tokens, self.sampler.sample(logits, rows).token_ids)
        else:
            accepted = rejection_sample(tokens, draft.probs, self.sampler.probs(logits, rows),
                                        r.generator or self.sampler.generator)
        all_accepted = len(accepted) == len(tokens) + 1
        # The draft model never ran on its last draft: if the target kept it, its cache lacks it.
        result = StepResult(accepted, num_rejected=len(tokens) + 1 - len(accepted),
                            draft_lag=int(self.drafter is not None and all_accepted))
        if r.params.logprobs:
            logprobs = torch.log_softmax(logits[:len(accepted)].float(), dim=-1)
            chosen = torch.tensor(accepted, device=logprobs.device)
            result.logprobs = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
            if r.params.top_logprobs:
                values, indices = logprobs.topk(r.params.top_logprobs, dim=-1)
                result.top_logprobs = [list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
        return result


def _masks(request, drafts: list[int], masks: StepMasks) -> torch.Tensor | None:
    return None if request.matcher is None else masks.get(request, drafts)


def _first(biases: torch.Tensor | None) -> torch.Tensor | None:
    return None if biases is None else biases[0]


def sampling_row(request, extra_output: list[int] = (), grammar_bias: torch.Tensor | None = None) -> SamplingRow:
    """The request's sampling row, as if extra_output (drafts before this position) were generated.
    A grammar decides where constrained output ends: min_tokens does not hold its EOS back."""
    output = request.output_token_ids + list(extra_output) if extra_output else request.output_token_ids
    free_eos = request.params.ignore_eos or request.matcher is not None
    return SamplingRow(params=request.params, prompt_token_ids=request.prompt_token_ids,
                       output_token_ids=output, generator=request.generator,
                       eos_token_ids=() if free_eos else request.eos_token_ids, grammar_bias=grammar_bias)

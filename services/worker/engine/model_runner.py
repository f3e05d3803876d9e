"""Turns a step plan into tensors, runs the model over the paged cache, and samples.

The runner owns the KV cache tensors and never sees the block pool. It keeps its own persistent
batch (input_batch.py), fed by the scheduler's step plans: new requests once, then diffs (token
counts, new block ids, drafts) and the ids that left; it reads no live Request on its main path
(a constrained row's masks come from StepMasks, which holds the matchers; a draft model still
reads the requests it drafts for). Each sequence contributes its new tokens to one flattened
batch; the logits of its last token (or of its k+1 verification positions) are sampled. With a
draft model (spec/draft_model.py) the drafts are made first, inside the same step; otherwise
they are the n-gram proposer's, in the plan. A constrained request's rows are sampled under its
grammar's masks (StepMasks): drafts outside the grammar are never accepted.
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
from services.worker.engine.input_batch import InputBatch, StepInputs
from services.worker.engine.sampler import Sampler, SamplingRow
from services.worker.engine.scheduler import ScheduledRequest, SchedulerOutput
from services.worker.engine.structured.step_masks import StepMasks
from services.worker.spec.rejection import rejection_sample, verify_greedy

log = logging.getLogger(__name__)


@dataclass(slots=True)
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
    query_lens = np.fromiter((len(s.token_ids) for s in spans), np.int64, n)
    ends = np.cumsum(query_lens)
    total = int(ends[-1])
    ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in spans), np.int64, total)
    query_start_loc = np.zeros(n + 1, np.int32)
    query_start_loc[1:] = ends
    starts = np.fromiter((s.start for s in spans), np.int64, n)
    if total == n:   # one token a span (decode): no expansion
        rows, positions = np.arange(n), starts
    else:
        rows = np.repeat(np.arange(n), query_lens)
        positions = starts[rows] + np.arange(total) - query_start_loc[:-1].astype(np.int64)[rows]
    table = block_table_array([s.block_ids for s in spans])
    inputs = device_inputs(ids, positions, slot_mapping(table, rows, positions, block_size), query_start_loc,
                           query_lens, starts + query_lens, table, block_size, device)
    return inputs, ends.tolist()


def device_inputs(ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, query_start_loc: np.ndarray,
                  query_lens: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int,
                  device: torch.device) -> ForwardInputs:
    """A step's host arrays on the device, each copied once, and the attention metadata over them
    (the one place a forward's inputs are made)."""
    def on_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)
    query_lens_cpu, seq_lens_cpu = query_lens.tolist(), seq_lens.tolist()
    meta = AttentionMetadata(
        query_start_loc=on_device(query_start_loc), seq_lens=on_device(seq_lens.astype(np.int32)),
        block_tables=on_device(block_tables), slot_mapping=on_device(slots),
        max_query_len=max(query_lens_cpu), max_seq_len=max(seq_lens_cpu), block_size=block_size,
        query_lens_cpu=query_lens_cpu, seq_lens_cpu=seq_lens_cpu)
    return ForwardInputs(on_device(ids), on_device(positions), meta)


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
        self.batch = InputBatch(block_size)
        self.decode_graphs = None
        if graph_max_batch:
            graphs = DecodeGraphs(model, self.kv_caches, block_size, max_model_len, graph_max_batch, device)
            try:
                graphs.capture()
                self.decode_graphs = graphs
            except RuntimeError:   # a model or kernel that cannot be captured still serves, eagerly
                log.exception("capturing decode CUDA graphs failed; decode steps run eagerly")

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, masks: StepMasks | None = None) -> dict[str, StepResult]:
        """Run one step plan. masks: the grammar masks of its constrained requests (none:
        unconstrained). Raises RequestStepError when the failure is some requests' own; a failed
        step leaves the seeded generators as they were, so a request run again draws the same
        numbers (and the requests it ran leave the batch: the scheduler aborts or requeues them)."""
        rows = self.batch.update(plan)
        generators = self.batch.generators(rows.tolist())
        states = [g.get_state() for g in generators]
        try:
            return self._execute(plan, rows, masks or StepMasks())
        except Exception:
            for g, state in zip(generators, states):
                g.set_state(state)
            raise

    def _execute(self, plan: SchedulerOutput, rows: np.ndarray, masks: StepMasks) -> dict[str, StepResult]:
        batch = plan.scheduled
        drafts = self._drafts(batch)
        inputs = self.batch.prepare(plan, rows, {rid: d.token_ids for rid, d in drafts.items()})
        if self.decode_graphs is not None and inputs.is_plain_decode and self.decode_graphs.fits(len(batch)):
            logits = self.decode_graphs.run(inputs.input_ids, inputs.positions, inputs.block_tables)
        else:
            logits = self._forward(inputs)
            if logits is None:
                return {}
        if inputs.sample_index is None:
            items = batch
        else:
            items = [batch[i] for i in np.flatnonzero(inputs.samples).tolist()]
            rows = rows[inputs.samples]
        return self._sample(items, rows, logits, drafts, masks)

    def _forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of the rows the step samples (None: it samples none)."""
        fwd = device_inputs(inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.query_start_loc,
                            inputs.query_lens, inputs.seq_lens, inputs.block_tables, self.block_size, self.device)
        hidden = self.model(fwd.input_ids, fwd.positions, self.kv_caches, fwd.meta)
        if inputs.sample_index is not None:
            if not len(inputs.sample_index):
                return None
            hidden = hidden[torch.from_numpy(inputs.sample_index).to(self.device)]
        return self.model.compute_logits(hidden)

    def _drafts(self, batch: list[ScheduledRequest]) -> dict[str, Draft]:
        if self.drafter is not None:
            return self.drafter.propose(batch)
        return {b.request_id: Draft(b.spec_token_ids) for b in batch if b.num_spec_tokens}

    def _sample(self, items: list[ScheduledRequest], rows: np.ndarray, logits: torch.Tensor,
                drafts: dict[str, Draft], masks: StepMasks) -> dict[str, StepResult]:
        """Plain rows are sampled together; speculative rows are verified per request. The tokens
        taken are appended to the batch once every row has sampled (a failed step appends none)."""
        results: dict[str, StepResult] = {}
        verified = []
        plain, plain_rows, plain_logit_rows, offset = [], [], [], 0
        for item, row in zip(items, rows.tolist()):
            k = item.num_spec_tokens
            if k == 0:
                plain.append(item)
                plain_rows.append(row)
                plain_logit_rows.append(offset)
            else:
                rid = item.request_id
                try:
                    results[rid] = self._verify(item, row, logits[offset:offset + k + 1], drafts[rid], masks)
                except Exception as error:
                    raise RequestStepError([rid], error) from error
                verified.append((row, results[rid].token_ids))
            offset += k + 1
        if plain:
            batch = self.batch
            sampling = batch.sampling_rows(plain_rows)
            if sampling is None:   # some row of the batch is constrained
                sampling = [batch.sampling_row(row, grammar_bias=_first(masks.get(item.request, [])))
                            if batch.constrained(row) else batch.sampling_row(row)
                            for item, row in zip(plain, plain_rows)]
            plain_logits = logits if len(plain) == logits.shape[0] else logits[plain_logit_rows]   # no copy when all
            try:
                out = self.sampler.sample(plain_logits, sampling)
            except Exception as error:
                raise self._blame(plain, plain_logits, sampling, error) from error
            logprobs, top = out.logprobs, out.top_logprobs
            for j, (item, token) in enumerate(zip(plain, out.token_ids)):
                results[item.request_id] = StepResult(
                    [token], [logprobs[j]] if logprobs is not None else None,
                    [top[j]] if top is not None else None)
            self.batch.append_one(np.array(plain_rows, np.int64), out.token_ids)
        for row, tokens in verified:
            self.batch.append(row, tokens)
        return results

    def _blame(self, items: list[ScheduledRequest], logits: torch.Tensor, rows: list[SamplingRow],
               error: Exception) -> RequestStepError:
        """The rows whose sampling fails on their own (all of them, if none does alone)."""
        culprits = []
        for j, item in enumerate(items):
            try:
                self.sampler.sample(logits[j:j + 1], rows[j:j + 1])
            except Exception:
                culprits.append(item.request_id)
        return RequestStepError(culprits or [item.request_id for item in items], error)

    def _verify(self, item: ScheduledRequest, row: int, logits: torch.Tensor, draft: Draft,
                masks: StepMasks) -> StepResult:
        tokens = draft.token_ids
        base = self.batch.sampling_row(row)
        params = base.params
        # Position j of the k+1 rows follows the drafts before it: penalties and the grammar must see them.
        biases = masks.get(item.request, tokens) if self.batch.constrained(row) else None
        rows = [self.batch.sampling_row(row, tokens[:j], None if biases is None else biases[j])
                for j in range(len(tokens) + 1)]
        if params.greedy:
            accepted = verify_greedy(tokens, self.sampler.sample(logits, rows).token_ids)
        else:
            accepted = rejection_sample(tokens, draft.probs, self.sampler.probs(logits, rows),
                                        base.generator or self.sampler.generator)
        all_accepted = len(accepted) == len(tokens) + 1
        # The draft model never ran on its last draft: if the target kept it, its cache lacks it.
        result = StepResult(accepted, num_rejected=len(tokens) + 1 - len(accepted),
                            draft_lag=int(self.drafter is not None and all_accepted))
        if params.logprobs:
            logprobs = torch.log_softmax(logits[:len(accepted)].float(), dim=-1)
            chosen = torch.tensor(accepted, device=logprobs.device)
            result.logprobs = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
            if params.top_logprobs:
                values, indices = logprobs.topk(params.top_logprobs, dim=-1)
                result.top_logprobs = [list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
        return result


def _first(biases: torch.Tensor | None) -> torch.Tensor | None:
    return None if biases is None else biases[0]


def sampling_row(request, extra_output: list[int] = (), grammar_bias: torch.Tensor | None = None) -> SamplingRow:
    """The request's sampling row, as if extra_output (drafts before this position) were generated.
    A grammar decides where constrained output ends: min_tokens does not hold its EOS back.
    (The draft model's; the runner's own rows come from its batch, built alike: NewRequest.of.)"""
    output = request.output_token_ids + list(extra_output) if extra_output else request.output_token_ids
    free_eos = request.params.ignore_eos or request.matcher is not None
    return SamplingRow(params=request.params, prompt_token_ids=request.prompt_token_ids,
                       output_token_ids=output, generator=request.generator,
                       eos_token_ids=() if free_eos else request.eos_token_ids, grammar_bias=grammar_bias)

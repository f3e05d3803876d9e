"""Turns a step plan into tensors, runs the model over the paged cache, and samples.

The runner owns the KV cache tensors and never sees the block pool. It keeps its own persistent
batch (input_batch.py), fed by the scheduler's step plans: new requests once, then diffs (token
counts, new block ids, drafts) and the ids that left; it reads no live Request (a constrained
row's masks come from StepMasks, which holds the matchers, and a draft model drafting for one asks
its matcher). Each sequence contributes its new tokens to one flattened batch; the logits of its
last token (or of its k+1 verification positions) are sampled. With a
draft model (spec/draft_model.py) the drafts are made first, inside the same step; otherwise
they are the n-gram proposer's, in the plan. A constrained request's rows are sampled under its
grammar's masks (StepMasks): drafts outside the grammar are never accepted.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from services.worker.attention.metadata import AttentionMetadata, block_table_array, slot_mapping
from services.worker.engine.decode_graphs import DecodeGraphs
from services.worker.engine.input_batch import InputBatch, PendingTokens, StepInputs
from services.worker.engine.sampler import DeviceSample, Sampler, SamplingRow
from services.worker.engine.scheduler import ScheduledRequest, SchedulerOutput
from services.worker.engine.step_results import StepResult, StepResults
from services.worker.engine.structured.step_masks import StepMasks
from services.worker.engine.transfer import to_device
from services.worker.spec.rejection import rejection_sample, verify_greedy

log = logging.getLogger(__name__)


@dataclass
class Draft:
    """The tokens one request verifies this step, and the distributions they were drawn from:
    probs [k, V], or None for a deterministic proposer (n-gram) or a greedy request."""
    token_ids: list[int]
    probs: torch.Tensor | None = None


@dataclass
class PendingStep:
    """A submitted step: the results known on the host (verified drafts) and, for its plain rows,
    the tokens still on their way from the device (sample) and where they go in the batch."""
    results: dict[str, StepResult]                         # the verified rows'

    sample: DeviceSample | None = None
    sampled_ids: list[str] = field(default_factory=list)   # the plain rows' requests, in sample order
    tokens: PendingTokens | None = None


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
        return to_device(a, device)
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
                 block_size: int, kv_cache_dtype: torch.dtype, device: torch.device, sampler: Sampler,
                 drafter=None, max_model_len: int = 0, graph_max_batch: int = 0) -> None:
        """drafter: a DraftModelProposer, or None when drafts (if any) come from the n-gram proposer.
        graph_max_batch: decode steps of up to this many rows run through DecodeGraphs (0: never),
        which needs an attention backend that reads only device tensors (Triton)."""
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.drafter = drafter
        self.kv_caches = kv_cache_tensors(num_layers, num_kv_heads, head_dim, num_blocks, block_size, kv_cache_dtype,
                                          device)
        self.batch = InputBatch(block_size)
        self._in_flight: list[PendingStep] = []   # submitted, not collected: at most two
        self.decode_graphs = None
        if graph_max_batch:
            graphs = DecodeGraphs(model, self.kv_caches, block_size, max_model_len, graph_max_batch, device)
            try:
                graphs.capture()
                self.decode_graphs = graphs
            except RuntimeError:   # a model or kernel that cannot be captured still serves, eagerly
                log.exception("capturing decode CUDA graphs failed; decode steps run eagerly")

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, masks: StepMasks | None = None) -> StepResults:
        """Run one step plan and wait for its results (submit, then collect)."""
        return self.collect(self.submit(plan, masks))

    @torch.inference_mode()
    def submit(self, plan: SchedulerOutput, masks: StepMasks | None = None) -> PendingStep:
        """Queue one step plan on the device; collect() gives its results. masks: the grammar masks
        of its constrained requests (none: unconstrained). One step may be in flight when the next
        is submitted: the tokens the next feeds back are read on the device, where the first left
        them (the host learns them only at collect). Raises RequestStepError when the failure is
        some requests' own; a failed step leaves the seeded generators as they were, so a request
        run again draws the same numbers (and the requests it ran leave the batch: the scheduler
        aborts or requeues them)."""
        if len(self._in_flight) > 1:
            raise RuntimeError("a step is submitted while two are in flight: collect the oldest first")
        rows = self.batch.update(plan)
        generators = self.batch.generators(rows.tolist())
        states = [g.get_state() for g in generators]
        try:
            pending = self._submit(plan, rows, masks or StepMasks())
        except Exception:
            for g, state in zip(generators, states):
                g.set_state(state)
            raise
        self._in_flight.append(pending)
        return pending

    def collect(self, pending: PendingStep) -> StepResults:
        """The results of the oldest step in flight (waits for its tokens, not for later steps)."""
        if not self._in_flight or self._in_flight[0] is not pending:
            raise RuntimeError("steps are collected in the order they were submitted")
        self._in_flight.pop(0)
        if pending.sample is None:
            return StepResults(pending.results)
        out = pending.sample.to_host()
        self.batch.resolve(pending.tokens, out.token_ids)
        return StepResults(pending.results, pending.sampled_ids, out.token_ids, out.logprobs, out.top_logprobs)

    def drop_in_flight(self) -> None:
        """Forget the steps in flight (after a failure; their requests are aborted)."""
        self._in_flight.clear()

    def _submit(self, plan: SchedulerOutput, rows: np.ndarray, masks: StepMasks) -> PendingStep:
        batch = plan.scheduled
        drafts = self._drafts(batch, rows)
        previous = self._in_flight[-1].tokens if self._in_flight else None
        inputs = self.batch.prepare(plan, rows, {rid: d.token_ids for rid, d in drafts.items()}, previous)
        feed = None
        if inputs.feed is not None:   # (token rows of this step, their tokens on the device)
            dst, src = inputs.feed
            feed = to_device(dst, self.device), self._in_flight[-1].sample.token_ids[to_device(src, self.device)]
        if self.decode_graphs is not None and inputs.is_plain_decode and self.decode_graphs.fits(len(batch)):
            logits = self.decode_graphs.run(inputs.input_ids, inputs.positions, inputs.block_tables, feed)
        else:
            logits = self._forward(inputs, feed)
            if logits is None:
                return PendingStep({})
        if inputs.sample_index is None:
            items = batch
        else:
            items = [batch[i] for i in np.flatnonzero(inputs.samples).tolist()]
            rows = rows[inputs.samples]
        return self._sample(items, rows, logits, drafts, masks)

    def _forward(self, inputs: StepInputs, feed: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
        """The logits of the rows the step samples (None: it samples none)."""
        fwd = device_inputs(inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.query_start_loc,
                            inputs.query_lens, inputs.seq_lens, inputs.block_tables, self.block_size, self.device)
        if feed is not None:
            fwd.input_ids.index_copy_(0, *feed)
        hidden = self.model(fwd.input_ids, fwd.positions, self.kv_caches, fwd.meta)
        if inputs.sample_index is not None:
            if not len(inputs.sample_index):
                return None
            hidden = hidden[to_device(inputs.sample_index, self.device)]
        return self.model.compute_logits(hidden)

    def _drafts(self, batch: list[ScheduledRequest], rows: np.ndarray) -> dict[str, Draft]:
        if self.drafter is not None:
            return self.drafter.propose(batch, rows.tolist(), self.batch)
        return {b.request_id: Draft(b.spec_token_ids) for b in batch if b.num_spec_tokens}

    def _sample(self, items: list[ScheduledRequest], rows: np.ndarray, logits: torch.Tensor,
                drafts: dict[str, Draft], masks: StepMasks) -> PendingStep:
        """Plain rows are sampled together, their tokens left on the device; speculative rows are
        verified per request, on the host. The batch takes the tokens once every row has sampled (a
        failed step appends none): the verified now, the plain ones as placeholders that collect
        fills in."""
        results: dict[str, StepResult] = {}
        verified = []
        all_plain = not drafts   # drafts holds exactly the verifying rows; most steps: none
        if all_plain:
            plain, plain_rows, plain_logit_rows = items, rows.tolist(), []
        else:
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
        pending = PendingStep(results)
        if plain:
            batch = self.batch
            sampling = batch.sampling_rows(plain_rows)
            if sampling is None:   # some row of the batch is constrained
                sampling = [batch.sampling_row(row, grammar_bias=_first(masks.get(item.request, [])))
                            if batch.constrained(row) else batch.sampling_row(row)
                            for item, row in zip(plain, plain_rows)]
            if len(plain) != logits.shape[0]:   # no copy when all
                logits = logits[to_device(np.array(plain_logit_rows, np.int64), logits.device)]
            try:
                pending.sample = self.sampler.sample_on_device(logits, sampling)
            except Exception as error:
                raise self._blame(plain, logits, sampling, error) from error
            pending.sampled_ids = [item.request_id for item in plain]
            pending.tokens = self.batch.append_placeholders(
                rows if all_plain else np.array(plain_rows, np.int64))
        for row, tokens in verified:
            self.batch.append(row, tokens)
        return pending

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

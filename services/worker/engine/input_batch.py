"""The runner's persistent batch: its own copy of every request it holds, fed by step plans.

One row per request the runner holds (rows are reused after a request leaves): its token ids
(prompt, then every token the runner sampled for it), its block table and its sampling row. A
plan (scheduler.py) removes the requests that left, adds new ones whole and applies the diffs of
the others (block ids appended since the runner last saw the table); the tokens the runner
samples are appended here, since the scheduler accepts every one of them up to a stop, and a
request that stopped leaves the batch at the next plan. A token sampled on the device is appended
as a placeholder the host fills in when it learns it; a step prepared meanwhile (overlap) is
told which of its input tokens to take from the device (StepInputs.feed). A step's inputs are
then gathered from the rows with a few numpy operations: no per-token Python and no live Request
read.

Invariant, checked every step: a row holds at least the tokens the plan schedules as known
(start_position + num_known_tokens <= its token count), and its table covers the step's tokens.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from services.worker.engine.sampler import SamplingRow
from services.worker.engine.scheduler import NewRequest, SchedulerOutput


class StepInputs(NamedTuple):
    """One step's flattened inputs, on the host. Sequence s owns tokens
    query_start_loc[s]:query_start_loc[s+1]."""
    rows: np.ndarray              # int64 [num seqs]: each scheduled request's batch row
    input_ids: np.ndarray         # int64 [num tokens]
    positions: np.ndarray         # int64 [num tokens]
    slot_mapping: np.ndarray      # int64 [num tokens]
    query_start_loc: np.ndarray   # int32 [num seqs + 1]
    query_lens: np.ndarray        # int64 [num seqs]
    seq_lens: np.ndarray          # int64 [num seqs]
    block_tables: np.ndarray      # int32 [num seqs, widest table]
    samples: np.ndarray           # bool [num seqs]: the step reaches the last known token
    sample_index: np.ndarray | None   # int64: the token rows whose logits are sampled (None: all)
    # Tokens of the step in flight this one reads (overlap): (their indices in input_ids, their
    # indices in that step's sampled tokens); None when every input token is on the host.
    feed: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def is_plain_decode(self) -> bool:
        """One known token a sequence, each sampled, nothing to verify."""
        return len(self.input_ids) == len(self.rows) and self.sample_index is None


class PendingTokens(NamedTuple):
    """Tokens a step sampled that the host does not know yet: placeholders at these rows and
    positions, for the requests whose row generation is gens (a row that changed hands since
    ignores them)."""
    rows: np.ndarray
    gens: np.ndarray
    positions: np.ndarray


class InputBatch:
    def __init__(self, block_size: int, rows: int = 8, tokens: int = 64, blocks: int = 4) -> None:
        self.block_size = block_size
        self._row_of: dict[str, int] = {}
        self._free: list[int] = []
        self.token_ids = np.zeros((rows, tokens), np.int64)
        self.num_tokens = np.zeros(rows, np.int64)
        self.block_table = np.zeros((rows, blocks), np.int32)
        self.num_blocks = np.zeros(rows, np.int64)
        self._gen = np.zeros(rows, np.int64)      # bumped when a row takes a request
        self._sampling: list[SamplingRow | None] = [None] * rows
        self._constrained = [False] * rows
        self._seeded: set[int] = set()        # rows whose sampling row has a generator
        self._num_constrained = 0             # rows sampled under a grammar

    # -- membership ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._row_of

    def row(self, request_id: str) -> int:
        return self._row_of[request_id]

    def update(self, plan: SchedulerOutput) -> np.ndarray:
        """Apply a plan: the requests that left go, new ones come, tables take their new block ids.
        -> each scheduled request's row."""
        for rid in plan.finished_ids:
            self._remove(rid)
        rows = []
        for item in plan.scheduled:
            if item.new is not None:
                row = self._add(item.request_id, item.new)
            else:
                row = self._row_of.get(item.request_id)
                if row is None:
                    raise RuntimeError(f"request {item.request_id!r} is scheduled as known to the runner, "
                                       "which does not hold it")
            if item.new_block_ids:
                self._write_blocks(row, item.block_start, item.new_block_ids)
            rows.append(row)
        return np.array(rows, np.int64)

    def _add(self, request_id: str, new: NewRequest) -> int:
        self._remove(request_id)
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self._row_of[request_id] = row
        self._gen[row] += 1
        n = len(new.token_ids)
        self._fit_tokens(n)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_blocks[row] = 0
        # The output list grows as tokens are appended: the row is built once, never per step.
        self._sampling[row] = SamplingRow(
            params=new.params, prompt_token_ids=new.token_ids[:new.num_prompt_tokens],
            output_token_ids=new.token_ids[new.num_prompt_tokens:], generator=new.generator,
            eos_token_ids=new.eos_token_ids)
        self._constrained[row] = new.constrained
        self._num_constrained += new.constrained
        if new.generator is not None:
            self._seeded.add(row)
        return row

    def _remove(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._gen[row] += 1   # its placeholders, if any, are no longer anyone's
            self._sampling[row] = None
            self._num_constrained -= self._constrained[row]
            self._constrained[row] = False
            self._seeded.discard(row)
            self._free.append(row)

    def _write_blocks(self, row: int, start: int, block_ids: list[int]) -> None:
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            self.block_table = _widen(self.block_table, end)
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def _grow_rows(self) -> None:
        old = len(self.num_tokens)
        new = 2 * old
        self.token_ids = _lengthen(self.token_ids, new)
        self.num_tokens = _lengthen(self.num_tokens, new)
        self.block_table = _lengthen(self.block_table, new)
        self.num_blocks = _lengthen(self.num_blocks, new)
        self._gen = _lengthen(self._gen, new)
        self._sampling += [None] * old
        self._constrained += [False] * old
        self._free += range(new - 1, old - 1, -1)

    def _fit_tokens(self, n: int) -> None:
        if n > self.token_ids.shape[1]:
            self.token_ids = _widen(self.token_ids, n)

    # -- what sampling reads -------------------------------------------------------------------

    def sampling_row(self, row: int, extra_output: Sequence[int] = (), grammar_bias=None) -> SamplingRow:
        """The row's sampling settings, as if extra_output (drafts before this position) were
        generated, under grammar_bias (a constrained row's mask)."""
        base = self._sampling[row]
        if not extra_output and grammar_bias is None:
            return base
        output = list(base.output_token_ids) + list(extra_output) if extra_output else base.output_token_ids
        return SamplingRow(base.params, base.prompt_token_ids, output, base.generator, base.eos_token_ids,
                           grammar_bias)

    def sampling_rows(self, rows: list[int]) -> list[SamplingRow] | None:
        """The rows' sampling settings when none of the batch's rows is constrained (else None:
        ask sampling_row per row, with its grammar's bias)."""
        if self._num_constrained:
            return None
        sampling = self._sampling
        return [sampling[row] for row in rows]

    def generators(self, rows: list[int]) -> list:
        """The seeded generators of the rows, in row order."""
        if not self._seeded:
            return []
        seeded, sampling = self._seeded, self._sampling
        return [sampling[row].generator for row in rows if row in seeded]

    def constrained(self, row: int) -> bool:
        return self._constrained[row]

    # -- tokens the runner sampled -------------------------------------------------------------

    def append(self, row: int, token_ids: list[int]) -> None:
        n = int(self.num_tokens[row])
        self._fit_tokens(n + len(token_ids))
        self.token_ids[row, n:n + len(token_ids)] = token_ids
        self.num_tokens[row] = n + len(token_ids)
        self._sampling[row].output_token_ids.extend(token_ids)

    def append_placeholders(self, rows: np.ndarray) -> PendingTokens:
        """One token to each of the (distinct) rows, not known yet: resolve() writes it. Until
        then a step that reads it takes it from the device (prepare's feed)."""
        ends = self.num_tokens[rows]
        self._fit_tokens(int(ends.max()) + 1)
        self.token_ids[rows, ends] = 0
        self.num_tokens[rows] = ends + 1
        return PendingTokens(rows, self._gen[rows], ends)

    def resolve(self, pending: PendingTokens, token_ids: list[int]) -> None:
        """The placeholders' tokens, now known, in place (rows still held by the same requests)."""
        live = self._live(pending)
        if live.all():
            rows, positions, tokens = pending.rows, pending.positions, token_ids
        else:
            rows, positions = pending.rows[live], pending.positions[live]
            tokens = [t for t, keep in zip(token_ids, live.tolist()) if keep]
        self.token_ids[rows, positions] = tokens
        sampling = self._sampling
        for row, token in zip(rows.tolist(), tokens):
            sampling[row].output_token_ids.append(token)

    # -- a step's inputs -----------------------------------------------------------------------

    def prepare(self, plan: SchedulerOutput, rows: np.ndarray, drafts: dict[str, list[int]],
                in_flight: PendingTokens | None = None) -> StepInputs:
        """The step's inputs from the rows (update's result): known tokens from the batch, then
        each request's drafts (drafts: request id -> the tokens it verifies). in_flight: the
        placeholders of the step still running, whose tokens this one reads on the device."""
        scheduled = plan.scheduled
        n = len(scheduled)
        starts = np.fromiter((s.start_position for s in scheduled), np.int64, n)
        query_lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, n)
        num_spec = np.fromiter((s.num_spec_tokens for s in scheduled), np.int64, n)
        known_end = starts + query_lens - num_spec
        num_tokens = self.num_tokens[rows]
        seq_lens = starts + query_lens
        if (known_end > num_tokens).any() or (self.num_blocks[rows] * self.block_size < seq_lens).any():
            raise RuntimeError("the plan schedules tokens or positions the runner's batch does not hold")
        samples = known_end >= num_tokens
        total = int(query_lens.sum())
        query_start_loc = np.zeros(n + 1, np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        if total == n:   # one token a sequence (decode): no expansion
            token_rows, positions = rows, starts
            input_ids = self.token_ids[rows, starts]
        else:
            seq_of_token = np.repeat(np.arange(n), query_lens)
            positions = starts[seq_of_token] + np.arange(total) - query_start_loc[:-1].astype(np.int64)[seq_of_token]
            token_rows = rows[seq_of_token]
            self._fit_tokens(int(seq_lens.max()))
            input_ids = self.token_ids[token_rows, positions]
            if num_spec.any():   # draft positions lie past the known tokens, in plan order
                is_draft = positions >= known_end[seq_of_token]
                input_ids[is_draft] = [t for s in scheduled if s.num_spec_tokens for t in drafts[s.request_id]]
        bs = self.block_size
        slots = self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        tables = self.block_table[rows, :int(self.num_blocks[rows].max())]
        counts = np.where(samples, num_spec + 1, 0)
        sample_index = None
        if int(counts.sum()) != total:
            first = query_start_loc[1:].astype(np.int64) - counts
            sample_index = np.repeat(first - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
        feed = None if in_flight is None else self._feed(in_flight, token_rows, positions)
        return StepInputs(rows, input_ids, positions, slots, query_start_loc, query_lens, seq_lens, tables,
                          samples, sample_index, feed)

    def _live(self, pending: PendingTokens) -> np.ndarray:
        """Which placeholders still belong to the requests that sampled them."""
        return self._gen[pending.rows] == pending.gens

    def _feed(self, in_flight: PendingTokens, token_rows: np.ndarray,
              positions: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Which input tokens are the in-flight step's placeholders, and which of its samples each is."""
        source = np.full(len(self.num_tokens), -1, np.int64)
        live = self._live(in_flight)
        source[in_flight.rows[live]] = np.flatnonzero(live)
        j = source[token_rows]
        hit = j >= 0
        hit[hit] = positions[hit] == in_flight.positions[j[hit]]
        if not hit.any():
            return None
        return np.flatnonzero(hit), j[hit]


def _widen(a: np.ndarray, columns: int) -> np.ndarray:
    out = np.zeros((a.shape[0], max(columns, 2 * a.shape[1])), a.dtype)
    out[:, :a.shape[1]] = a
    return out


def _lengthen(a: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros((rows, *a.shape[1:]), a.dtype)
    out[:len(a)] = a
    return out

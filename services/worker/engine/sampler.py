"""Turns a batch of logits into next tokens, one row per request.

The pipeline, as in vLLM: penalties, min_tokens, logit_bias and a constrained row's grammar mask
(last, so nothing can lift a forbidden token back) on the raw logits; greedy rows take the argmax
there; random rows go on through temperature, min_p, top_k and top_p, then draw from the softmax.
A draw inverts the row's cumulative distribution at one uniform number from its generator, so a
seeded row gets the same tokens whatever else is in the batch and wherever it sits. (The
exponential race, argmax(p / q) with q ~ Exp(1), needs V numbers a row: generating them took
about 7 ms of a CPU decode step of 32 rows, some 60 ms.) Reported logprobs are of the raw model distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from services.worker.engine.penalties import apply_penalties, has_penalties, suppress_stop_tokens
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.transfer import HostCopy, tensor_on


@dataclass
class SamplingRow:
    """One row of logits to sample from."""
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]      # generated so far: penalties and min_tokens
    generator: torch.Generator | None    # per request when seeded, on the logits' device; else None
    eos_token_ids: Sequence[int] = ()    # suppressed with stop_token_ids while output < min_tokens
    grammar_bias: torch.Tensor | None = None    # float32 [V]: 0 where a grammar allows the token, -inf elsewhere


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None                         # of each chosen token; None if no row asked
    top_logprobs: list[list[tuple[int, float]]] | None   # per row, descending; None if no row asked


@dataclass
class DeviceSample:
    """A batch's sampled tokens, still on the logits' device (the next step can read them there),
    with the logprobs asked for; their copy to the host is under way (transfer.py)."""
    token_ids: torch.Tensor                  # int64 [N]
    _copy: HostCopy
    _top_counts: list[int] | None = None     # per row, when some row asked for logprobs

    def to_host(self) -> SampleResult:
        tokens, chosen, values, ids = self._copy.get()
        if self._top_counts is None:
            return SampleResult(tokens.tolist(), None, None)
        if values is None:
            return SampleResult(tokens.tolist(), chosen.tolist(), None)
        top = [list(zip(ids[i, :k].tolist(), values[i, :k].tolist())) for i, k in enumerate(self._top_counts)]
        return SampleResult(tokens.tolist(), chosen.tolist(), top)


class Sampler:
    def __init__(self, generator: torch.Generator | None = None):
        """generator: shared by unseeded rows; None uses torch's default for the logits' device."""
        self.generator = generator

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
        """logits [N, V], float. Never modifies them."""
        return self.sample_on_device(logits, rows).to_host()

    def sample_on_device(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> DeviceSample:
        """sample, with the tokens left on the device and the host not waiting for them (on CUDA
        the path has no synchronising copy for rows without penalties, min_tokens or a grammar)."""
        tokens, random, probs = self._process(logits, rows)
        if random:
            drawn = self._draw(probs, [rows[i].generator for i in random])
            if len(random) == len(rows):
                tokens = drawn
            else:
                tokens[_index(random, tokens.device)] = drawn
        return _with_logprobs(logits, tokens, rows)

    def probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """[N, V], the distribution `sample` draws from; greedy rows are one-hot at their argmax.
        Speculative decoding verifies drafts against it."""
        tokens, random, probs = self._process(logits, rows)
        distribution = torch.zeros(logits.shape, device=logits.device).scatter_(1, tokens[:, None], 1.0)
        if random:
            distribution[_index(random, logits.device)] = probs
        return distribution

    def _process(self, logits: torch.Tensor, rows: Sequence[SamplingRow]
                 ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """The greedy choice of every row, the indices of the random rows, and their distributions."""
        if all(row.params.greedy and not _adjusts(row) for row in rows):   # the common batch: argmax alone,
            _check_logits(logits, rows)                                      # no vocabulary-sized copy
            return logits.argmax(-1), [], None
        adjusted = self._adjust(logits, rows)
        greedy_tokens = adjusted.argmax(-1)
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not random:
            return greedy_tokens, random, None
        # truncated_probs works in place: on our own copy when every row is random.
        subset = adjusted if len(random) == len(rows) else adjusted[_index(random, adjusted.device)]
        return greedy_tokens, random, truncated_probs(subset, [rows[i].params for i in random])

    def _adjust(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """A float32 copy of logits with penalties, min_tokens, logit_bias and grammar masks applied."""
        _check_logits(logits, rows)
        adjusted = logits.to(torch.float32, copy=True)
        penalised = [i for i, row in enumerate(rows) if has_penalties(row)]
        if penalised:
            subset = adjusted[penalised]
            apply_penalties(subset, [rows[i] for i in penalised])
            adjusted[penalised] = subset
        suppress_stop_tokens(adjusted, rows)
        _add_logit_bias(adjusted, rows)
        masked = [i for i, row in enumerate(rows) if row.grammar_bias is not None]
        if masked:
            bias = torch.stack([rows[i].grammar_bias for i in masked]).to(adjusted.device)
            if len(masked) == len(rows):
                adjusted.add_(bias)
            else:
                adjusted[masked] += bias
        return adjusted

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token per row of probs; seeded rows draw from their own generator."""
        if all(g is None for g in generators):
            return draw(probs, self.generator)
        uniform = torch.empty(len(generators), 1, device=probs.device)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            uniform[_index(shared, probs.device)] = torch.rand(len(shared), 1, device=probs.device,
                                                               generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                uniform[i].uniform_(generator=g)
        return _inverse_cdf(probs, uniform)


def _check_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {list(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")


def _adjusts(row: SamplingRow) -> bool:
    """Whether anything changes the row's logits before its choice (see _adjust)."""
    p = row.params
    return bool(has_penalties(row) or p.logit_bias or row.grammar_bias is not None
                or (p.min_tokens and len(row.output_token_ids) < p.min_tokens))


def _add_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: each row's logit_bias added to its tokens' logits (ids checked at admission)."""
    row_index, token_index, bias = [], [], []
    for i, row in enumerate(rows):
        for token, value in row.params.logit_bias.items():
            row_index.append(i)
            token_index.append(token)
            bias.append(value)
    if row_index:
        device = logits.device
        logits.index_put_((tensor_on(row_index, torch.long, device), tensor_on(token_index, torch.long, device)),
                          tensor_on(bias, logits.dtype, device), accumulate=True)


def truncated_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """softmax after temperature, min_p, top_k, top_p (vLLM's order). Non-greedy rows only;
    modifies logits in place."""
    def column(values: list[float]) -> torch.Tensor:
        return tensor_on(values, logits.dtype, logits.device)[:, None]

    logits.div_(column([p.temperature for p in params]))
    if any(p.min_p > 0 for p in params):
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf keeps all.
        floor = logits.amax(-1, keepdim=True) + column([p.min_p for p in params]).log()
        logits.masked_fill_(logits < floor, float("-inf"))
    if any(p.top_k > 0 for p in params):
        _top_k(logits, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        _top_p(logits, column([p.top_p for p in params]))
    return logits.softmax(-1)


def _top_k(logits: torch.Tensor, top_k: list[int]) -> None:
    """In place: keeps the k highest logits of each row, and ties with the k-th. 0 is off."""
    vocab_size = logits.shape[1]
    active = [0 < k < vocab_size for k in top_k]
    ks = [k if on else 1 for k, on in zip(top_k, active)]
    k = tensor_on(ks, torch.long, logits.device)[:, None]
    kth = logits.topk(max(ks), dim=-1).values.gather(1, k - 1)
    kth = torch.where(tensor_on(active, torch.bool, logits.device)[:, None], kth, float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))


TOP_P_CANDIDATES = 1024


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place: keeps the fewest most likely tokens whose mass reaches top_p (never none), and
    ties with the least likely of them. top_p [N, 1]; 1 is off.

    Sorting the whole vocabulary dominates on a CPU, so only the best TOP_P_CANDIDATES of each
    row are sorted when they hold the mass every row needs, which makes the result exact."""
    on = top_p < 1.0
    probs = logits.softmax(-1)
    ordered = probs.topk(min(TOP_P_CANDIDATES, probs.shape[1]), dim=-1).values
    if bool((on & (ordered.sum(-1, keepdim=True) < top_p)).any()):
        ordered = probs.sort(dim=-1, descending=True).values
    kept = ((ordered.cumsum(-1) - ordered) < top_p).sum(-1, keepdim=True)   # >= 1: the first has 0 before it
    least_kept = ordered.gather(1, kept - 1)
    logits.masked_fill_(on & (probs < least_kept), float("-inf"))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """A sample from each row of probs [..., V] (rows need not be normalised): one uniform number
    a row from generator."""
    return _inverse_cdf(probs, torch.rand(*probs.shape[:-1], 1, device=probs.device, generator=generator))


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The first token of each row whose cumulative mass passes uniform [..., 1] x the row's total:
    token i with probability p_i / total. The point stays below the total (u < 1, and the exact
    product lies more than half a float32 step below it), so it falls where the mass rises: a
    token of no mass (a masked one) is never the first to pass it. A row of no mass at all gets
    its last token."""
    cdf = probs.float().cumsum(-1)
    point = uniform * cdf[..., -1:]
    return torch.searchsorted(cdf, point, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices as a device tensor: indexing a CUDA tensor with a list copies it, synchronising."""
    return tensor_on(rows, torch.long, device)


def _with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SamplingRow]) -> DeviceSample:
    if not any(row.params.logprobs for row in rows):
        return DeviceSample(tokens, HostCopy([tokens, None, None, None]))
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    counts = [row.params.top_logprobs for row in rows]
    values = ids = None
    if max(counts):
        values, ids = logprobs.topk(min(max(counts), logits.shape[1]), dim=-1)
    return DeviceSample(tokens, HostCopy([tokens, chosen, values, ids]), counts)

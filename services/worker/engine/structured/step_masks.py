"""The grammar masks of one step, computed on a helper thread while the forward pass runs.

What a constrained row may sample this step depends only on the tokens it has already accepted,
all known when the step is scheduled, so the masks are started then and collected when the
logits are sampled (unpacked into logit biases there too). Draft tokens known before the step (n-gram) get their masks in the same job;
drafts a draft model makes inside the step are masked when they are verified, on the engine thread.
While a job runs, only it touches its requests' matchers.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from services.worker.engine.request import Request
from services.worker.engine.scheduler import ScheduledRequest


class StepMasks:
    def __init__(self, future: Future | None = None) -> None:
        self._future = future
        self._masks: dict[str, tuple[list[int], torch.Tensor]] | None = None if future else {}

    @classmethod
    def start(cls, executor: ThreadPoolExecutor, batch: list[ScheduledRequest], drafts_in_step: bool) -> StepMasks:
        jobs = []
        for item in batch:
            r = item.request
            if item.samples and r.matcher is not None and not (drafts_in_step and item.num_spec_tokens):
                jobs.append((r, r.spec_token_ids[:item.num_spec_tokens] if item.num_spec_tokens else []))
        return cls(executor.submit(_compute, jobs)) if jobs else cls()

    def get(self, request: Request, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, vocab]: the grammar's logit biases after each prefix of drafts (GrammarMatcher.masks)."""
        if self._masks is None:
            self._masks = self._future.result()
        found = self._masks.get(request.request_id)
        if found is not None and found[0] == drafts:
            return found[1]
        return request.matcher.masks(drafts)

    def wait(self) -> None:
        """Let the job finish (also when the step failed or never read some of its masks)."""
        if self._future is not None:
            self._future.exception()


def _compute(jobs: list[tuple[Request, list[int]]]) -> dict[str, tuple[list[int], torch.Tensor]]:
    return {r.request_id: (drafts, r.matcher.masks(drafts)) for r, drafts in jobs}

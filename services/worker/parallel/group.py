"""A tensor-parallel group: which rank this process is, how many there are, and the two
collectives the model needs (an all-reduce after each row-parallel layer, an all-gather of the
vocabulary-split logits).

SINGLE (size 1) is the default everywhere: its collectives are the identity, so a model built
without a group is exactly the one-device model. Collectives carry the group's timeout (set at
init_process_group, parallel/driver.py), so a dead rank raises in the caller instead of hanging it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, concatenated along the last dimension in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    def piece(self, full: int, local: int) -> slice:
        """This rank's `local` of `full` entries: its 1/size share, or, where local * size > full
        (KV heads replicated over more ranks than there are heads), the share's head."""
        start = (self.rank * full // self.size) // local * local
        return slice(start, start + local)


SINGLE = TensorParallel()


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads a rank holds: its share, or one (replicated) when there are fewer than ranks."""
    return max(1, num_kv_heads // size)

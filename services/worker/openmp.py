"""How torch's OpenMP threads wait between parallel regions: set before torch loads OpenMP.

A CPU step runs a few hundred parallel regions (each product, each large elementwise op). Measured
with bench-load's burst of 32 through the engine in bfloat16, 2 threads on the 2-core VM:
- Spinning long (libgomp's default, 300 000 turns) serves one busy process best (~195 tokens/s),
  but when the cores are shared (several workers, a router, a gateway on one machine) every region
  waits for a descheduled thread: two such engines side by side did not finish in 150 s (with
  10 000 turns neither; 1 token/s instead of 17 in an earlier measurement).
- Sleeping at once (OMP_WAIT_POLICY=PASSIVE) pays a futex wake-up per region: 130-166 tokens/s
  alone; two engines side by side 89-114 each.
- SPIN_COUNT turns (microseconds) catch the next region of a busy step and give way when the cores
  are shared: 144-194 tokens/s alone; two engines side by side 97-115 each.
An operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
"""

from __future__ import annotations

import os

SPIN_COUNT = 1000


def set_wait_policy() -> None:
    """Call before torch is imported (libgomp reads its environment when it loads)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))

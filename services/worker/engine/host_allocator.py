"""glibc's malloc kept from handing a CPU step's large buffers back to the kernel.

A decode step on a CPU allocates and frees tensors of megabytes many times (a batch of 32's
vocabulary-sized logits alone are 6 MiB in float32). glibc serves each with a fresh mmap, or
trims the heap's top once they are freed, so every step faults their pages in again, zeroed: on
the 2-core VM that was about a fifth of a decode step of 32 (a softmax over 6 MiB took 5.6 ms
against 0.5 ms on warm pages). Served from the heap, and the heap never trimmed, those pages stay
mapped: the process keeps its peak heap, which a worker reaches in its first prefill anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20     # glibc's largest: blocks above it are still mmapped, and unmapped when freed
TRIM_THRESHOLD = (1 << 31) - 1


def keep_freed_memory() -> bool:
    """Tune this process's malloc (glibc only; elsewhere nothing changes). -> whether it took."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.info("malloc left as it was: mallopt refused the thresholds")
    return ok

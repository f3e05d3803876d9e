"""What this machine's CPU computes natively, read from /proc/cpuinfo (torch-free)."""

from __future__ import annotations

import functools


@functools.cache
def flags_line() -> bytes:
    """The CPU's feature-flag line ("flags" on x86, "Features" on Arm), empty where /proc has none."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return b""


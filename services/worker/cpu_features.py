"""What this CPU can do, read once from /proc/cpuinfo: the flags the CPU attention kernel is
compiled for (its build key), and whether bfloat16 matrix products run natively, which decides
the dtype "auto" picks on a CPU."""

from __future__ import annotations

import functools
import os

# x86: AVX-512 BF16 dot products (Cooper Lake, Zen 4 and later) or AMX tiles (Sapphire Rapids);
# Arm: the BF16 extension (Graviton 3, Neoverse V1). Without one, oneDNN emulates bfloat16
# products and they run many times slower than float32 (docs/perf/engine.md).
BFLOAT16_FLAGS = frozenset({b"avx512_bf16", b"amx_bf16", b"bf16"})


@functools.cache
def _cpuinfo_line(*keys: bytes) -> bytes:
    """The first line of /proc/cpuinfo that starts with one of `keys` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(keys)), b"")
    except OSError:
        return b""


def cpu_flags() -> bytes:
    """The CPU's feature-flag line ("flags" on x86, "Features" on Arm; empty where /proc has none)."""
    return _cpuinfo_line(b"flags", b"Features")


def flag_set() -> frozenset[bytes]:
    """The flag line's flags, each a whole word."""
    return frozenset(cpu_flags().partition(b":")[2].split())


def has_native_bfloat16() -> bool:
    """Whether bfloat16 matrix products run in hardware here."""
    return not BFLOAT16_FLAGS.isdisjoint(flag_set())


def cpu_model() -> str:
    """The CPU's model name ("model name" on x86; empty where /proc says none)."""
    return _cpuinfo_line(b"model name").partition(b":")[2].strip().decode(errors="replace")


def summary(model: str, flags: frozenset[bytes], cpus: int) -> str:
    """A machine as a benchmark's figures need it said: which CPU, how many, and the vector units
    that decide what runs fast on it (the dtype "auto" picks among them)."""
    vectors = "AVX-512 " if b"avx512f" in flags else "AVX2 " if b"avx2" in flags else ""
    bfloat16 = "with" if not BFLOAT16_FLAGS.isdisjoint(flags) else "without"
    return f"{model or 'an unnamed CPU'}, {cpus} CPUs, {vectors}{bfloat16} bfloat16 units"


def this_machine() -> str:
    """summary() of the machine this runs on."""
    return summary(cpu_model(), flag_set(), os.cpu_count() or 1)

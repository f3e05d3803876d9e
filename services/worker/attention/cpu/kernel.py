"""paged_attention.c, compiled for this machine on first use and called through ctypes.

The C source (with paged_attention_rows.h, its rows kernel written once for float32, bfloat16
and a float32 query over a bfloat16 cache) is built with the system's C compiler (CC, else cc)
into a per-user cache keyed by the source, the flags and the CPU, so a worker builds it once
(well under a second) and later starts load it. -march=native needs the key's CPU: a cache shared
by different machines keeps one build per CPU. It links the OpenMP runtime torch already loaded
(libgomp.so.1, by soname), so the kernel's threads are torch's, not a second pool competing for
the same cores.

No compiler (an image without one, as deploy/docker/worker-cpu.Dockerfile), or a build that
fails: load() returns None, saying why once (a failed build as a warning), and the CPU path stays
on the PyTorch reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from services.worker.cpu_features import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
HEADERS = (Path(__file__).with_name("paged_attention_rows.h"),)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class PagedAttentionKernel:
    """The compiled library's entry points, typed: the rows kernel per (query, cache) element
    types, its limits."""

    SYMBOLS = {("float32", "float32"): "llmserve_paged_attention_rows",
               ("float32", "bfloat16"): "llmserve_paged_attention_rows_f32_bf16_cache",
               ("bfloat16", "bfloat16"): "llmserve_paged_attention_rows_bf16"}

    def __init__(self, library: ctypes.CDLL) -> None:
        self._rows = {}
        for dtypes, symbol in self.SYMBOLS.items():
            rows = self._rows[dtypes] = getattr(library, symbol)
            rows.argtypes = [_P, _I64, _P, _P, _P, _P, _I64, _P, _P, _P, _P, _I64, _I, _I, _I, _I,
                             ctypes.c_float, _I]
            rows.restype = None
        self._supports = library.llmserve_paged_attention_limits
        self._supports.argtypes = [_I, _I]
        self._supports.restype = _I

    def supports(self, group: int, head_dim: int) -> bool:
        """Whether a layer of num_heads / num_kv_heads = group and this head_dim fits the kernel."""
        return bool(self._supports(group, head_dim))

    def attend_rows(self, dtypes: tuple[str, str], query, query_row_stride: int, out, key_cache, value_cache,
                    block_tables, table_stride: int, rows, seqs, starts, ends, num_rows: int, num_heads: int,
                    num_kv_heads: int, head_dim: int, block_size: int, scale: float, num_threads: int) -> None:
        """Pointers (ints) to query/out and caches of `dtypes` (a key of SYMBOLS: the query's, the
        caches') and to int32 tables/rows/seqs/starts/ends."""
        self._rows[dtypes](query, query_row_stride, out, key_cache, value_cache, block_tables, table_stride,
                          rows, seqs, starts, ends, num_rows, num_heads, num_kv_heads, head_dim, block_size,
                          scale, num_threads)


@functools.cache
def load() -> PagedAttentionKernel | None:
    """The kernel built for this machine (cached), or None where it cannot be built."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        log.info("no C compiler %r on PATH: CPU attention runs on the PyTorch reference", compiler)
        return None
    try:
        return PagedAttentionKernel(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.SubprocessError) as error:
        log.warning("CPU paged-attention kernel unavailable, using the PyTorch reference: %s", error)
        return None


def _build(compiler: str) -> Path:
    sources = [path.read_bytes() for path in (SOURCE, *HEADERS)]
    key = hashlib.sha256(b"\0".join([*sources, " ".join(FLAGS).encode(), compiler.encode(),
                                     platform.machine().encode(), cpu_flags()])).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmserve" / "kernels"
    library = cache / f"paged_attention-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:   # built aside, then moved: concurrent starts are safe
        built = Path(tmp) / library.name
        result = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE)], capture_output=True,
                                text=True, timeout=120)
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, library)
    return library


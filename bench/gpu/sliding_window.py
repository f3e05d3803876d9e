"""Sliding-window attention: the Triton backend with a window against the same batch attended
in full, at Gemma 3 12B's attention shape (16 query heads, 8 KV heads, head_dim 256, bf16, block
16, window 1024): decode batches and one long prefill chunk, per context length.

A windowed layer reads only the blocks its rows' windows reach, so its time should stay flat as
the context grows while the full layer's grows with it; `window GB/s` is the KV bytes inside the
windows over the windowed time. Timed as CUDA-graph replays, each batch over its own randomly
scattered blocks; the max abs difference is against the PyTorch reference with the same window.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bench.gpu import harness


@dataclass(frozen=True)
class Setup:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    window: int
    batches: tuple[int, ...]       # decode batches
    contexts: tuple[int, ...]
    chunk: int                     # new tokens of the prefill chunk, timed at each context
    reference_max_tokens: int      # check against the PyTorch reference up to this batch x context


GEMMA3_12B = Setup(16, 8, 256, 16, 1024, batches=(16, 64), contexts=(2048, 8192, 32768), chunk=2048,
                   reference_max_tokens=16 * 8192)
SMOKE = Setup(4, 2, 64, 16, 16, batches=(2,), contexts=(40, 100), chunk=9, reference_max_tokens=10**9)


def main(argv: Sequence[str] | None = None) -> int:
    args = harness.parse_args(__doc__.splitlines()[0], argv)
    device = harness.select_device(args.smoke)
    from services.worker.attention.metadata import AttentionMetadata
    from services.worker.attention.torch_paged import TorchPagedAttention
    from services.worker.attention.triton.backend import TritonPagedAttention

    setup = SMOKE if args.smoke else GEMMA3_12B
    dtype = torch.bfloat16
    backend = TritonPagedAttention(num_sms=None if device.type == "cuda" else 8)
    bytes_per_token = 2 * setup.num_kv_heads * setup.head_dim * dtype.itemsize
    num_blocks = max(setup.batches) * -(-max(setup.contexts) // setup.block_size)
    shape = (num_blocks, setup.block_size, setup.num_kv_heads, setup.head_dim)
    key_cache = torch.empty(shape, dtype=dtype, device=device).normal_()
    value_cache = torch.empty(shape, dtype=dtype, device=device).normal_()
    scale = setup.head_dim ** -0.5

    def metadata(batch: int, context: int, q_len: int) -> AttentionMetadata:
        blocks_per_seq = -(-context // setup.block_size)
        tables = torch.randperm(num_blocks, device=device)[:batch * blocks_per_seq].to(torch.int32)
        return AttentionMetadata(
            query_start_loc=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device),
            seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
            block_tables=tables.view(batch, blocks_per_seq),
            slot_mapping=torch.zeros(batch * q_len, dtype=torch.int64, device=device),
            max_query_len=q_len, max_seq_len=context, block_size=setup.block_size,
            query_lens_cpu=[q_len] * batch, seq_lens_cpu=[context] * batch)

    cases = [("decode", b, 1) for b in setup.batches] + [(f"prefill chunk of {setup.chunk}", 1, setup.chunk)]
    rows = []
    for context in setup.contexts:
        for kind, batch, q_len in cases:
            if q_len > context:
                continue
            meta = metadata(batch, context, q_len)
            query = torch.randn(batch * q_len, setup.num_heads, setup.head_dim, device=device).to(dtype)
            attend = lambda window: backend.attend(  # noqa: E731
                query, key_cache, value_cache, meta, scale, window)
            t_full = harness.seconds_per_call([lambda: attend(None)], device)
            t_window = harness.seconds_per_call([lambda: attend(setup.window)], device)
            seen = min(context, setup.window + q_len - 1)
            err = ""
            if batch * context <= setup.reference_max_tokens:
                expected = TorchPagedAttention().attend(query, key_cache, value_cache, meta, scale,
                                                        setup.window)
                err = f"{(attend(setup.window).float() - expected.float()).abs().max().item():.1e}"
            rows.append([kind, batch, context, f"{t_full * 1e6:.1f}", f"{t_window * 1e6:.1f}",
                         f"{t_full / t_window:.2f}x", f"{batch * seen * bytes_per_token / t_window / 1e9:.0f}",
                         err])

    title = (f"# Sliding-window attention on {harness.device_name(device)}\n\n"
             f"{setup.num_heads} query heads, {setup.num_kv_heads} KV heads, head_dim {setup.head_dim}, "
             f"bfloat16, block {setup.block_size}, window {setup.window}; Triton backend, CUDA-graph "
             f"replays.\n\n")
    harness.report("gpu_sliding_window.md", title + harness.markdown_table(
        ["step", "batch", "context", "full µs", "window µs", "speed-up", "window GB/s", "max diff"], rows))
    harness.check_imports()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode attention bandwidth: the Triton paged-attention backend against a device memory copy
measured in the same run, at the Llama-3-8B attention shape (32 query heads, 8 KV heads,
head_dim 128, bf16, block 16), batch 1..256 x context 512..16k.

Bandwidth = KV bytes read / time. Every sequence's blocks are scattered at random over a cache
sized for the largest case; small cases rotate over several disjoint block tables so that the
bytes they touch exceed the L2 cache (else they would time L2, not HBM). Kernels are timed as
CUDA-graph replays (no launch overhead, as in an engine that replays graphs); the PyTorch
reference, eagerly, for the small cases only.
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
    dtype: torch.dtype
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    reference_max_tokens: int     # time the PyTorch reference up to batch x context of this
    working_set_bytes: int        # rotate block tables until the bytes touched reach this
    copy_bytes: int


LLAMA3_8B = Setup(32, 8, 128, 16, torch.bfloat16, batches=(1, 4, 16, 64, 256),
                  contexts=(512, 2048, 8192, 16384), reference_max_tokens=16 * 2048,
                  working_set_bytes=256 << 20, copy_bytes=2 << 30)
SMOKE = Setup(4, 2, 64, 16, torch.bfloat16, batches=(2,), contexts=(40, 600),
              reference_max_tokens=10**9, working_set_bytes=0, copy_bytes=1 << 20)


def main(argv: Sequence[str] | None = None) -> int:
    args = harness.parse_args(__doc__.splitlines()[0], argv)
    device = harness.select_device(args.smoke)
    from services.worker.attention.metadata import AttentionMetadata
    from services.worker.attention.torch_paged import TorchPagedAttention
    from services.worker.attention.triton.backend import TritonPagedAttention
    from services.worker.attention.triton.paged_attention import paged_attention

    setup = SMOKE if args.smoke else LLAMA3_8B
    # On the CPU, pretend to have 8 multiprocessors so that the split-KV path runs too.
    backend = TritonPagedAttention(num_sms=None if device.type == "cuda" else 8)
    reference = TorchPagedAttention()
    copy = harness.copy_bandwidth(device, setup.copy_bytes)
    bytes_per_token = 2 * setup.num_kv_heads * setup.head_dim * setup.dtype.itemsize  # K and V
    num_blocks = max(max(setup.batches) * -(-max(setup.contexts) // setup.block_size),
                     setup.working_set_bytes // (bytes_per_token * setup.block_size))
    cache_shape = (num_blocks, setup.block_size, setup.num_kv_heads, setup.head_dim)
    key_cache = torch.empty(cache_shape, dtype=setup.dtype, device=device).normal_()
    value_cache = torch.empty(cache_shape, dtype=setup.dtype, device=device).normal_()
    scale = setup.head_dim ** -0.5

    def decode_batches(batch: int, context: int) -> list[AttentionMetadata]:
        """Decode metadata over disjoint, randomly scattered blocks, enough to exceed L2."""
        blocks_per_seq = -(-context // setup.block_size)
        kv_bytes = batch * context * bytes_per_token
        count = max(1, min(num_blocks // (batch * blocks_per_seq),
                           -(-setup.working_set_bytes // kv_bytes)))
        order = torch.randperm(num_blocks, device=device).to(torch.int32)
        per_table = batch * blocks_per_seq
        return [AttentionMetadata(
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
            seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
            block_tables=order[i * per_table:(i + 1) * per_table].view(batch, blocks_per_seq),
            slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
            max_query_len=1, max_seq_len=context, block_size=setup.block_size,
            query_lens_cpu=[1] * batch, seq_lens_cpu=[context] * batch) for i in range(count)]

    rows = []
    for context in setup.contexts:
        for batch in setup.batches:
            metas = decode_batches(batch, context)
            query = torch.randn(batch, setup.num_heads, setup.head_dim, device=device).to(setup.dtype)
            kv_bytes = batch * context * bytes_per_token
            attend = lambda m: backend.attend(query, key_cache, value_cache, m, scale)  # noqa: E731
            unified = lambda m: paged_attention(  # noqa: E731
                query, key_cache, value_cache, m.block_tables, m.seq_lens, m.query_start_loc, 1,
                scale)
            t_auto = harness.seconds_per_call([lambda m=m: attend(m) for m in metas], device)
            splits = backend.num_splits(metas[0], setup.num_kv_heads, device)
            t_unified = t_auto if splits == 1 else harness.seconds_per_call(
                [lambda m=m: unified(m) for m in metas], device)
            t_ref, err = "", ""
            if batch * context <= setup.reference_max_tokens:
                attend_ref = lambda: reference.attend(  # noqa: E731
                    query, key_cache, value_cache, metas[0], scale)
                t_ref = f"{harness.seconds_per_call([attend_ref], device, graph=False) * 1e6:.0f}"
                diff = attend(metas[0]).float() - attend_ref().float()
                err = f"{diff.abs().max().item():.1e}"
            rows.append([batch, context, f"{kv_bytes / 2**20:.0f}", len(metas),
                         f"split x{splits}" if splits > 1 else "unified",
                         f"{t_auto * 1e6:.1f}", f"{kv_bytes / t_auto / 1e9:.0f}",
                         f"{100 * kv_bytes / t_auto / copy:.0f}%", f"{t_unified * 1e6:.1f}",
                         t_ref, err])

    title = (f"# Decode attention on {harness.device_name(device)}\n\n"
             f"{setup.num_heads} query heads, {setup.num_kv_heads} KV heads, head_dim "
             f"{setup.head_dim}, {str(setup.dtype).removeprefix('torch.')}, block "
             f"{setup.block_size}. Device copy of {setup.copy_bytes >> 20} MiB: "
             f"{copy / 1e9:.0f} GB/s (read + write). Triton times are CUDA-graph replays over "
             f"`tables` disjoint block tables; torch is the eager PyTorch reference, with its max "
             f"abs difference from Triton.\n\n")
    harness.report("gpu_kernels.md", title + harness.markdown_table(
        ["batch", "context", "KV MiB", "tables", "path", "Triton µs", "GB/s", "of copy",
         "unified µs", "torch µs", "max diff"], rows))
    harness.check_imports()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode steps through DecodeGraphs' static, padded buffers (services/worker/engine/decode_graphs.py).

On the CPU nothing is captured: the same padded path runs eagerly under the Triton interpreter,
so these tests check everything a CUDA graph replays except the capture itself: the buffers,
the padding rows (which must write no KV), the fixed attention metadata (split-KV segments past
a row's context are empty) and the engine choosing the path only for plain decode steps.
"""

from __future__ import annotations

import pytest
import torch

from services.worker.attention.torch_paged import TorchPagedAttention
from services.worker.attention.triton.backend import TritonPagedAttention
from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine
from services.worker.engine.decode_graphs import DecodeGraphs, bucket_sizes
from services.worker.engine.model_runner import SeqSpan, forward_pass
from services.worker.engine.sampling_params import SamplingParams
from services.worker.model.loader import load_model
from tests.worker.test_engine import run

CPU = torch.device("cpu")
BLOCK = 16
MAX_LEN = 512   # with 64 "SMs", decode batches of up to 16 sequences get 2 split-KV segments


@pytest.fixture(scope="module")
def triton_model():
    return load_model("random:tiny", torch.float32, CPU, TritonPagedAttention(num_sms=64))


@pytest.fixture(scope="module")
def torch_model():
    return load_model("random:tiny", torch.float32, CPU, TorchPagedAttention())


@pytest.mark.parametrize("max_batch, sizes", [
    (1, [1]), (4, [1, 2, 4]), (6, [1, 2, 4, 6]), (20, [1, 2, 4, 8, 16, 20]),
    (256, [1, 2, 4, *range(8, 257, 8)]),
])
def test_bucket_sizes(max_batch, sizes):
    assert bucket_sizes(max_batch) == sizes


def test_padded_rows_write_no_kv_and_real_rows_match_the_eager_pass(triton_model):
    model = triton_model.model
    cfg = model.config
    shape = (12, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    torch.manual_seed(0)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(cfg.num_layers)]
    reference = [(k.clone(), v.clone()) for k, v in caches]
    # Three rows, padded to the bucket of 4: contexts inside a block, at a block's end, across blocks.
    tables, positions, tokens = [[3], [5, 9], [7, 2, 11]], [4, 31, 40], [101, 202, 303]
    graphs = DecodeGraphs(model, caches, BLOCK, MAX_LEN, max_batch=4, device=CPU)
    graphs.rows.fill_(7)                    # stale rows from an earlier, larger step
    graphs.block_tables.fill_(10)
    logits = graphs.run(tokens, positions, tables).clone()

    spans = [SeqSpan([t], p, table) for t, p, table in zip(tokens, positions, tables)]
    hidden, _ = forward_pass(model, reference, spans, BLOCK, CPU)
    expected = model.compute_logits(hidden)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    for (k, v), (k_ref, v_ref) in zip(caches, reference):
        # The eager pass wrote the same three slots with the same values; the padding row nothing.
        torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)


def _engine(loaded, **kwargs):
    cfg = EngineConfig(num_blocks=64, block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=8, **kwargs)
    return build_engine(ModelSourceConfig(source="random:tiny"), cfg, loaded=loaded).engine


def _greedy(engine, prompts: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
    results = run(engine, {rid: (ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
                           for rid, (ids, max_tokens) in prompts.items()})
    return {rid: result.tokens for rid, result in results.items()}


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_decodes_through_the_graph_path_token_for_token(triton_model, torch_model, monkeypatch, overlap):
    shared = list(range(300, 340))          # two full blocks shared through the prefix cache
    prompts = {
        "a": (list(range(100, 105)), 3),
        "b": (shared + [7, 8], 5),
        "c": (shared + [9], 7),
        "d": (list(range(200, 217)), 9),
        "e": (list(range(400, 433)), 12),
    }
    engine = _engine(triton_model, attention_backend="triton", cuda_graph_max_batch=4, async_scheduling=overlap)
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    steps, fed = [], []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda *a: steps.append(len(a[0])) or fed.append(a[3] is not None) or run(*a))
    got = _greedy(engine, prompts)
    expected = _greedy(_engine(torch_model, attention_backend="torch"), prompts)
    assert got == expected
    # Five decode rows exceed the largest bucket (eager); then 4, 3 (padded to 4), 2 and 1 replay.
    assert {4, 3, 2, 1} <= set(steps) and max(steps) == 4
    assert any(fed) == overlap          # overlapped decode steps take their tokens on the device
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


@pytest.mark.parametrize("backend, max_batch, expected", [("torch", 256, None), ("triton", 0, None),
                                                          ("triton", 256, 8), ("triton", 3, 3)])
def test_graphs_only_with_the_triton_backend_and_bounded_by_max_num_seqs(
        triton_model, torch_model, backend, max_batch, expected):
    loaded = triton_model if backend == "triton" else torch_model
    engine = _engine(loaded, attention_backend=backend, cuda_graph_max_batch=max_batch)
    graphs = engine.runner.decode_graphs
    assert (graphs.sizes[-1] if graphs else None) == expected


def test_a_failed_capture_leaves_decode_steps_eager(triton_model, torch_model, monkeypatch):
    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "capture", fail)
    engine = _engine(triton_model, attention_backend="triton", cuda_graph_max_batch=4)
    assert engine.runner.decode_graphs is None
    prompts = {"a": (list(range(100, 121)), 4)}
    assert _greedy(engine, prompts) == _greedy(_engine(torch_model, attention_backend="torch"), prompts)

"""engine.kv_cache_dtype: a float32 model over a bfloat16 KV cache. Keys and values are rounded
once, when written; every backend reads them back widened and attends in the query's precision;
the pool holds twice the tokens in the same memory. A cache wider than the model, or an unknown
type, is refused with the reason."""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from llmserve.v1 import worker_pb2 as pb
from llmserve.v1 import worker_pb2_grpc
from services.worker.attention.backend import select_backend
from services.worker.engine.build import resolve_kv_cache_dtype
from services.worker.model.shapes import NAMED_SHAPES
from services.worker.sizing import kv_bytes_per_token
from tests.worker.core_procs import core_worker
from tests.worker.paged_batches import make_batch
from tests.worker.test_cpu_attention import LONG
from tests.worker.test_torch_paged_attention import cpu_backend, dense_causal_attention

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")   # the Triton interpreter


def float32_queries_over_bfloat16_caches(seqs, **shape):
    """A batch whose caches (and dense keys and values) are bfloat16 and whose query is float32
    with bits a bfloat16 could not hold."""
    batch = make_batch(seqs, dtype=torch.bfloat16, **shape)
    batch.query = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(7))
    return batch


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (4, 4, 5)])
def test_the_cpu_kernel_attends_a_float32_query_over_a_bfloat16_cache(num_heads, num_kv_heads, head_dim):
    """The kernel's own variant serves the decode rows (not the reference) and is exact to float32
    rounding over the cached bfloat16 values; the prefill row, on the reference, too."""
    batch = float32_queries_over_bfloat16_caches(LONG, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                                 head_dim=head_dim, block_size=16, shared_blocks=2, seed=head_dim)
    scale = 1 / math.sqrt(head_dim)
    out = cpu_backend().attend(batch.query, batch.key_cache, batch.value_cache, batch.meta, scale)
    assert out.dtype == torch.float32 and ("cpu", None) in batch.meta.plans
    torch.testing.assert_close(out.double(), dense_causal_attention(batch, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_other_backends_attend_over_a_bfloat16_cache(backend):
    """The reference widens the gathered keys and values; Triton (here its interpreter) converts
    them as it loads, as it converts the query, to the cache's type (on a GPU a bfloat16 product)."""
    batch = float32_queries_over_bfloat16_caches([(37, 1), (0, 17), (20, 13), (50, 4)], num_heads=6,
                                                 num_kv_heads=2, head_dim=64, block_size=16, shared_blocks=1)
    out = select_backend(backend, torch.device("cpu")).attend(batch.query, batch.key_cache, batch.value_cache,
                                                              batch.meta, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), dense_causal_attention(batch, 0.125), atol=1e-5, rtol=1e-5)


# Triton's interpreter truncates where a GPU rounds to nearest: within one bfloat16 step there.
@pytest.mark.parametrize("backend, rtol", [("torch", 0), ("cpu", 0), ("triton", 2 ** -7)])
def test_keys_and_values_are_rounded_once_when_written(backend, rtol):
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    key_cache = torch.zeros(2, 4, 2, 8, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([5, 0, 7])
    select_backend(backend, torch.device("cpu")).write_kv(key, value, key_cache, value_cache, slots)
    for cache, written in ((key_cache, key), (value_cache, value)):
        assert cache.dtype == torch.bfloat16
        torch.testing.assert_close(cache.view(8, 2, 8)[slots].float(), written.to(torch.bfloat16).float(),
                                   rtol=rtol, atol=0)


def test_auto_is_the_models_and_a_narrower_type_is_taken():
    assert resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16) == torch.bfloat16


@pytest.mark.parametrize("name, model_dtype, message", [
    ("float32", torch.bfloat16, "kv_cache_dtype float32 is wider than the model's bfloat16"),
    ("fp8", torch.float32, "unknown engine.kv_cache_dtype 'fp8'; expected auto or one of"),
    ("", torch.float32, "unknown engine.kv_cache_dtype ''"),
])
def test_a_wider_or_unknown_cache_type_is_refused(name, model_dtype, message):
    with pytest.raises(ValueError, match=message):
        resolve_kv_cache_dtype(name, model_dtype)


def test_a_worker_with_a_bfloat16_cache_under_float32_holds_twice_the_tokens_and_serves(tmp_path):
    """A real worker: its pool is sized by the cache's two bytes an element, and it answers."""
    memory_gb = 0.05
    per_block = kv_bytes_per_token(NAMED_SHAPES["smollm2-135m"], "bfloat16") * 16
    with core_worker(tmp_path, model__dtype="float32", engine__kv_cache_dtype="bfloat16", engine__num_blocks="0",
                     engine__kv_cache_memory_gb=str(memory_gb)) as worker, \
            grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.GenerationStub(channel)
        [model] = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
        assert model.dtype == "float32"
        request = pb.GenerateRequest(model=model.name, token_ids=pb.TokenIdsPrompt(ids=[1, 9690, 198, 504, 3458]),
                                     sampling=pb.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        tokens = [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]
        assert len(tokens) == 6
        load = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
        assert load.kv_blocks_total == int(memory_gb * 2**30 // per_block) - 1   # less the pool's null block


def test_a_worker_asked_for_a_wider_cache_exits_with_the_error(tmp_path):
    with pytest.raises(RuntimeError, match="kv_cache_dtype float32 is wider than the model's bfloat16"):
        with core_worker(tmp_path, model__dtype="bfloat16", engine__kv_cache_dtype="float32"):
            pass

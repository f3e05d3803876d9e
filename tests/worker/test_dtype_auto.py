"""dtype "auto": bfloat16 where the hardware multiplies it natively, float32 on other CPUs and
under int8 weights; a worker reports the dtype it resolved, not "auto"."""

from __future__ import annotations

import grpc
import pytest
import torch

from llmserve.v1 import worker_pb2 as pb
from llmserve.v1 import worker_pb2_grpc
from services.worker import cpu_features
from services.worker.engine import build
from services.worker.engine.build import dtype_name, resolve_dtype
from tests.worker.core_procs import core_worker

CPU = torch.device("cpu")


@pytest.mark.parametrize("line, native", [
    (b"flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_fp16\n", True),        # Zen 4, Sapphire Rapids
    (b"flags\t\t: fpu avx512f amx_bf16 amx_tile\n", True),
    (b"Features\t: fp asimd sve bf16 i8mm\n", True),                               # Graviton 3
    (b"flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n", False),           # Cascade Lake
    (b"flags\t\t: fpu avx512_bf16x\n", False),                                     # whole flags only
    (b"", False),                                                                  # no /proc/cpuinfo
])
def test_native_bfloat16_is_read_from_the_flags(monkeypatch, line, native):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: line)
    assert cpu_features.has_native_bfloat16() is native


@pytest.mark.parametrize("native, quantization, expected", [
    (True, "none", torch.bfloat16), (False, "none", torch.float32), (True, "int8", torch.float32)])
def test_auto_on_a_cpu(monkeypatch, native, quantization, expected):
    monkeypatch.setattr(build, "has_native_bfloat16", lambda: native)
    assert resolve_dtype("auto", CPU, quantization) == expected


def test_named_dtypes_stay_and_unknown_ones_are_refused():
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert dtype_name(resolve_dtype("float16", CPU)) == "float16"
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; expected auto or one of"):
        resolve_dtype("fp8", CPU)


def test_a_worker_on_auto_reports_and_serves_the_resolved_dtype(tmp_path):
    expected = dtype_name(resolve_dtype("auto", CPU))
    with core_worker(tmp_path, model__dtype="auto") as worker, grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.GenerationStub(channel)
        [model] = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
        assert model.dtype == expected
        request = pb.GenerateRequest(model=model.name, token_ids=pb.TokenIdsPrompt(ids=[1, 9690, 198]),
                                     sampling=pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        tokens = [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]
        assert len(tokens) == 4


def test_a_worker_with_an_unknown_dtype_exits_with_the_error(tmp_path):
    with pytest.raises(RuntimeError, match="unknown dtype 'fp8'"):
        with core_worker(tmp_path, model__dtype="fp8"):
            pass

"""bench-load's report says on which machine and when each part ran: a run of some parts keeps the
others' figures, so one load.md can mix machines, and a ratio across two of them says nothing."""

import json

from bench import load
from services.worker.cpu_features import summary

ZEN4 = summary("AMD EPYC 9R14", frozenset({b"avx2", b"avx512f", b"avx512_bf16"}), 2)
XEON = summary("Intel(R) Xeon(R) Processor", frozenset({b"avx2", b"avx512f", b"avx512_vnni"}), 2)
BF16 = {load.MODEL: "bfloat16", load.INT8_MODEL: "float32"}


def test_a_machine_is_said_by_its_cpu_its_count_and_its_vector_units():
    assert ZEN4 == "AMD EPYC 9R14, 2 CPUs, AVX-512 with bfloat16 units"
    assert XEON == "Intel(R) Xeon(R) Processor, 2 CPUs, AVX-512 without bfloat16 units"
    assert summary("", frozenset({b"avx2"}), 4) == "an unnamed CPU, 4 CPUs, AVX2 without bfloat16 units"
    assert summary("Neoverse-V1", frozenset({b"asimd", b"bf16"}), 8) == "Neoverse-V1, 8 CPUs, with bfloat16 units"


def burst_report(peers_machine: str) -> dict:
    row = dict(model=load.MODEL, warm=False, requests=32, served=32, refused=0, tps=150.0, ttft_p50=4.0, ttft_p95=8.0)
    return dict(burst=[row], transformers={"bfloat16": {"tps": 50.0}}, llama_cpp={"tps": 40.0, "ttft_p95": 60.0},
                measured={"burst": dict(started="2026-12-07 21:02 UTC", machine=ZEN4, dtypes=BF16),
                          "peers": dict(started="2026-12-07 21:29 UTC", machine=peers_machine, dtypes=BF16)})


def test_each_section_says_where_and_when_its_parts_ran():
    md = load.render(burst_report(ZEN4))
    assert f"Measured on {ZEN4}: burst at 2026-12-07 21:02 UTC; peers at 2026-12-07 21:29 UTC." in md
    assert "| 3.00x (bfloat16) | 3.75x |" in md


def test_no_ratio_against_peers_measured_on_another_machine():
    md = load.render(burst_report(XEON))
    assert f"Measured on {ZEN4}: burst at 2026-12-07 21:02 UTC / on {XEON}: peers at 2026-12-07 21:29 UTC." in md
    assert "| 150.0 | 4.00 | 8.00 | - | - |" in md                  # the burst row keeps no ratio
    assert "| transformers in bfloat16, static batches of 8 | | | 50.0 |" in md   # the peer's own row stays


def test_a_later_run_of_some_parts_keeps_the_others_provenance(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "OUT", tmp_path)
    load.write_report(burst_report(ZEN4))
    later = dict(measured={"poisson": dict(started="2026-12-08 01:57 UTC", machine=XEON, dtypes=BF16)})
    load.write_report(later)
    measured = json.loads((tmp_path / "load.json").read_text())["measured"]
    assert sorted(measured) == ["burst", "peers", "poisson"]
    assert measured["burst"]["machine"] == ZEN4 and measured["poisson"]["machine"] == XEON

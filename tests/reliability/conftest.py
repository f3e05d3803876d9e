"""Fixtures of the reliability suite: the worker tests' in-process model (reused, not copied), the
gateway tests' conversations service, and the real-process platform of platform.py."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.gateway.conftest import conversations_address  # noqa: F401  (session: real conversations service)
from tests.reliability.platform import Platform, launch
from tests.worker.conftest import smollm2  # noqa: F401  (session fixture: SmolLM2 on the CPU)


@pytest.fixture(scope="session")
def platform(tmp_path_factory) -> Iterator[Platform]:
    """Two workers, a router, conversations and two gateway replicas sharing one DB. Tests that
    kill or restart a process bring it back before they end. Admission has make run's CPU targets
    (deploy/local/run.py): at the GPU's 20 tokens/s a stream, how many streams these CPU workers
    may run depends on the machine's load, and these tests are not about admission."""
    p = launch(tmp_path_factory.mktemp("platform"), overload__stream_tokens_per_s="2.0",
               overload__ttft_target_s="2.0")
    try:
        yield p
    finally:
        p.stop()

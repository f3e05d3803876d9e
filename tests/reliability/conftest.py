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
    kill or restart a process bring it back before they end."""
    p = launch(tmp_path_factory.mktemp("platform"))
    try:
        yield p
    finally:
        p.stop()

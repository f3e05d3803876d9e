"""Fixtures of the gateway tests: the real conversations service (one process for the session),
and gateways over the scripted fake upstream."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import openai
import pytest

from tests.gateway.harness import GatewayHarness, gateway_config, redis_key_prefix
from tests.procs import free_port, service


@pytest.fixture(scope="session")
def conversations_address(tmp_path_factory) -> Iterator[str]:
    port, tmp = free_port(), tmp_path_factory.mktemp("conversations")
    address = f"127.0.0.1:{port}"
    env = {"LLMSERVE_CONVERSATIONS__SERVER__PORT": str(port), "LLMSERVE_CONVERSATIONS__SERVER__METRICS_PORT": "0",
           "LLMSERVE_CONVERSATIONS__STORE__URL": f"sqlite:///{tmp / 'conversations.db'}"}
    with service("services.conversations", env, address, tmp, timeout=60):
        yield address


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, conversations_address) -> Iterator[GatewayHarness]:
    db = Path(tmp_path_factory.mktemp("gateway")) / "gateway.db"
    with GatewayHarness(gateway_config(f"sqlite:///{db}", conversations_address)) as harness:
        yield harness


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """Synchronous, so that other fixtures can ask for it by name."""
    with redis_key_prefix() as prefix:
        yield prefix


@pytest.fixture(scope="module")
def key(gateway: GatewayHarness, request) -> str:
    """A fresh organization's API key, one per test module (named after it)."""
    return gateway.new_org(request.module.__name__.rsplit(".", 1)[-1])[2]


@pytest.fixture(scope="module")
def client(gateway: GatewayHarness, key: str) -> openai.OpenAI:
    """The openai SDK on that key, without retries (a test sees every status)."""
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)

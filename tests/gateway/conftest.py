"""Fixtures of the gateway tests: the real conversations service (one process for the session),
and gateways over the scripted fake upstream."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import pytest
import redis

from tests.gateway.harness import REDIS_URL, GatewayHarness, gateway_config
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
def redis_prefix():
    """A fresh key prefix; its keys are deleted afterwards. Synchronous, so `backend` can ask for it."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as e:
        client.close()
        pytest.fail(f"Redis at {REDIS_URL} is unreachable ({e!r}); the rate limiter and replica tests need it running "
                    f"(set LLMSERVE_TEST_REDIS_URL to use another one)")
    prefix = f"llmserve:test:rl:{uuid.uuid4().hex}:"
    yield prefix
    keys = list(client.scan_iter(match=prefix + "*"))
    if keys:
        client.delete(*keys)
    client.close()

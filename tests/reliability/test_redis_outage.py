"""Redis goes away under the gateway's rate limiter, and comes back.

A throwaway redis-server of our own on a free port (never the machine's shared one on 6379) backs
a gateway (the real app, over the gateway tests' scripted upstream). With it down, fail-open lets
requests through unmetered and fail-closed refuses them with 503; either way the backend error is
counted in llmserve_gateway_ratelimit_backend_errors_total and logged. When it returns, limits
apply again.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
from prometheus_client import REGISTRY

from tests.gateway.harness import GatewayHarness, gateway_config
from tests.procs import free_port

RPM = 3
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}


class OwnRedis:
    """redis-server on a free loopback port, in memory only; stop() and start() on the same port."""

    def __init__(self, tmp: Path):
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed: the Redis outage test needs its own server"
        self.binary, self.port, self.tmp = binary, free_port(), tmp
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--dir", str(self.tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise TimeoutError(f"our redis-server on {self.port} did not start")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@pytest.fixture
def own_redis(tmp_path):
    server = OwnRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def backend_errors(mode: str) -> float:
    return REGISTRY.get_sample_value("llmserve_gateway_ratelimit_backend_errors_total", {"mode": mode}) or 0.0


def decisions(result: str) -> float:
    return REGISTRY.get_sample_value("llmserve_gateway_ratelimit_decisions_total",
                                     {"result": result, "dimension": "none"}) or 0.0


@pytest.mark.parametrize("fail_mode", ["open", "closed"])
def test_redis_outage_fails_as_configured_and_limits_resume(own_redis, tmp_path, conversations_address, fail_mode,
                                                            caplog):
    cfg = gateway_config(f"sqlite:///{tmp_path / 'g.db'}", conversations_address,
                         rate_limit={"backend": "redis", "redis_url": own_redis.url, "fail_mode": fail_mode,
                                     "key_prefix": f"rel:{fail_mode}:"})
    with GatewayHarness(cfg) as gw:
        secret = gw.new_org("redis-outage", rpm=RPM)[2]
        headers = {"Authorization": f"Bearer {secret}"}

        def statuses(n: int) -> list[int]:
            return [gw.http.post("/v1/chat/completions", json=CHAT, headers=headers).status_code for _ in range(n)]

        assert statuses(RPM + 1) == [200] * RPM + [429]              # limits hold with Redis up

        own_redis.stop()
        errors, degraded = backend_errors(fail_mode), decisions("degraded" if fail_mode == "open" else "unavailable")
        with caplog.at_level(logging.WARNING, logger="services.gateway.ratelimit.redis_backend"):
            started = time.monotonic()
            down = statuses(4)
            elapsed = time.monotonic() - started
        expected = 200 if fail_mode == "open" else 503
        assert down == [expected] * 4
        if fail_mode == "closed":
            refused = gw.http.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert refused.json()["error"]["code"] == "rate_limiter_unavailable" and refused.headers["Retry-After"]
        assert backend_errors(fail_mode) - errors >= 4                 # every failure counted
        assert decisions("degraded" if fail_mode == "open" else "unavailable") - degraded >= 4
        assert f"fail-{fail_mode}" in caplog.text and own_redis.url in caplog.text   # and logged (rate-limited)
        assert elapsed < 4 * 5, "each decision must be bounded by ratelimit.redis_timeout_s, not hang"

        own_redis.start()                                              # back, empty: the buckets start full
        back = statuses(RPM + 2)
        # Limits resume; at most the first call after the restart may still see the stale connection.
        assert 429 in back and back.index(429) in (RPM, RPM + 1), back

"""The real gateway app on a free loopback port, in a thread with its own event loop (so the sync
openai client can call it), over the scripted fake upstream and the real conversations service."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
import uuid
from typing import Any, Coroutine, Iterator

import httpx
import pytest
import redis
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider

from services.gateway.app import GATEWAY, Gateway, build_app
from services.gateway.config import GatewayConfig
from tests.gateway.fake_upstream import FakeGeneration, start_fake_upstream

ADMIN_TOKEN = "test-admin-token"
REDIS_URL = os.environ.get("LLMSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@contextlib.contextmanager
def redis_key_prefix() -> Iterator[str]:
    """A fresh key prefix in the real Redis; its keys are deleted afterwards."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as e:
        client.close()
        pytest.fail(f"Redis at {REDIS_URL} is unreachable ({e!r}); the gateway's rate limiter and replica "
                    f"tests need it running (set LLMSERVE_TEST_REDIS_URL to use another one)", pytrace=False)
    prefix = f"llmserve:test:{uuid.uuid4().hex}:"
    try:
        yield prefix
    finally:
        keys = list(client.scan_iter(match=prefix + "*"))
        if keys:
            client.delete(*keys)
        client.close()


def gateway_config(database_url: str, conversations_address: str, **sections: Any) -> GatewayConfig:
    cfg = GatewayConfig()
    cfg.server.plain_http = True
    cfg.server.port = 0
    cfg.server.max_body_bytes = 64 * 1024
    cfg.database.url = database_url
    cfg.conversations.address = conversations_address
    cfg.auth.admin_token = ADMIN_TOKEN
    cfg.upstream.keepalive_interval_s = 0.2
    for name, values in sections.items():
        setattr(cfg, name, dataclasses.replace(getattr(cfg, name), **values))
    return cfg


class GatewayHarness:
    def __init__(self, cfg: GatewayConfig, tracer_provider: TracerProvider | None = None, fake_upstream: bool = True):
        """With fake_upstream=False the gateway talks to cfg.upstream.address (a real worker or router)."""
        self.cfg = cfg
        self.fake_upstream = fake_upstream
        self.tracer_provider = tracer_provider
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gateway", daemon=True)
        self.fake: FakeGeneration | None = None
        self.base_url = ""
        self._runner: web.AppRunner | None = None
        self._grpc_server = None

    def __enter__(self) -> "GatewayHarness":
        self.thread.start()
        self.call(self._start())
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.call(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()

    async def _start(self) -> None:
        if self.fake_upstream:
            self._grpc_server, self.fake, self.cfg.upstream.address = await start_fake_upstream()
        app = build_app(self.cfg, self.tracer_provider)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.base_url, timeout=10)
        self.app = app

    async def _stop(self) -> None:
        self.http.close()
        await self._runner.cleanup()
        if self._grpc_server is not None:
            await self._grpc_server.stop(0)

    def call(self, coro: Coroutine, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def gateway(self) -> Gateway:
        return self.app[GATEWAY]

    def drain(self) -> None:
        """Waits for the bookkeeping of finished requests (usage, reconcile, conversation append)."""
        self.call(self.gateway.drain())

    def admin(self, method: str, path: str, json: Any = None, token: str = ADMIN_TOKEN) -> httpx.Response:
        return self.http.request(method, path, json=json, headers={"Authorization": f"Bearer {token}"})

    def new_org(self, name: str = "acme", rpm: int = 0, tpm: int = 0, key_rpm: int | None = None,
                key_tpm: int | None = None) -> tuple[str, str, str]:
        """(org id, key id, secret) of a fresh organization with one key."""
        org = self.admin("POST", "/admin/v1/organizations", {"name": name, "rpm_limit": rpm, "tpm_limit": tpm})
        assert org.status_code == 201, org.text
        body = {"name": f"{name}-key"}
        if key_rpm is not None:
            body["rpm_limit"] = key_rpm
        if key_tpm is not None:
            body["tpm_limit"] = key_tpm
        key = self.admin("POST", f"/admin/v1/organizations/{org.json()['id']}/keys", body)
        assert key.status_code == 201, key.text
        return org.json()["id"], key.json()["id"], key.json()["key"]

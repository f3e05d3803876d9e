"""Fixtures: fake workers and routers, each stopped at the end of its test."""

from __future__ import annotations

import pytest
from tests.router.router_fakes import FakeWorker, RouterClient

from services.router.app import Router
from services.router.config import RouterConfig


def pytest_configure(config):
    config.addinivalue_line("markers", "real_workers: starts real worker processes (SmolLM2 on the CPU)")


@pytest.fixture
async def fake_workers():
    """Factory: `await fake_workers(n, model)` starts n fakes; all are stopped at the end."""
    started: list[FakeWorker] = []

    async def start(n: int = 1, model: str = "m", **kw) -> list[FakeWorker]:
        workers = [await FakeWorker(model, **kw).start() for _ in range(n)]
        started.extend(workers)
        return workers

    yield start
    for w in started:
        w.release()
        await w.server.stop(None)


@pytest.fixture
async def start_router():
    """Factory: `await start_router(config)` starts a router and returns a RouterClient."""
    clients: list[RouterClient] = []

    async def start(config: RouterConfig) -> RouterClient:
        router = Router(config)
        await router.start()
        clients.append(RouterClient(router))
        return clients[-1]

    yield start
    for client in clients:
        await client.channel.close()
        await client.router.stop(0)

"""Fixtures: every behavioural test runs against both stores, through a real gRPC server.

Postgres: one uniquely named database per test session on 127.0.0.1:5432, dropped at the end;
tests share it and stay apart by using fresh organization ids.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import uuid

import asyncpg
import grpc
import pytest
from llmserve.v1 import conversations_pb2_grpc

from .harness import config_for
from services.conversations.service import ConversationsService

PG_HOST, PG_PORT, PG_USERS = "127.0.0.1", 5432, ("postgres", "root")


async def _admin_connection() -> asyncpg.Connection:
    errors = []
    for user in PG_USERS:
        try:
            return await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=user, database="postgres", timeout=5)
        except (OSError, asyncpg.PostgresError, asyncio.TimeoutError) as e:
            errors.append(f"{user}: {e}")
    pytest.fail(f"PostgreSQL is needed at {PG_HOST}:{PG_PORT} (trust auth, user postgres or root): "
                + "; ".join(errors), pytrace=False)


@pytest.fixture(scope="session")
def postgres_url():
    name = f"llmserve_conversations_test_{os.getpid()}_{secrets.token_hex(4)}"

    async def create() -> str:
        conn = await _admin_connection()
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
            return await conn.fetchval("SELECT current_user")
        finally:
            await conn.close()

    async def drop() -> None:
        conn = await _admin_connection()
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    user = asyncio.run(create())
    yield f"postgresql://{user}@{PG_HOST}:{PG_PORT}/{name}"
    asyncio.run(drop())


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/conversations.db"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
async def service(store_url):
    service = ConversationsService(config_for(store_url))
    await service.start()
    yield service
    await service.stop()


@pytest.fixture
async def stub(service):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
        yield conversations_pb2_grpc.ConversationsStub(channel)


@pytest.fixture
def org() -> str:
    return f"org-{uuid.uuid4().hex[:12]}"

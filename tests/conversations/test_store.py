"""The stores directly: atomic appends, migrations, store URLs; and the page token and config."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid

import asyncpg
import pytest

from llmserve.config import load_config
from services.conversations import migrations
from services.conversations.config import ConversationsConfig, StoreConfig
from services.conversations.pagination import decode_page_token, encode_page_token
from services.conversations.store import ConversationNotFound, Cursor, NewMessage, open_store


@pytest.fixture
async def store(store_url):
    store = await open_store(StoreConfig(url=store_url))
    yield store
    await store.close()


async def test_failed_append_stores_nothing_and_keeps_its_key(store, org):
    conversation = await store.create(org, "t", "", {})
    # The database's own role check fails on the second message, after the first was inserted.
    bad = [NewMessage("user", "first"), NewMessage("narrator", "second")]
    with pytest.raises((sqlite3.IntegrityError, asyncpg.CheckViolationError)):
        await store.append(org, conversation.id, bad, "turn-1")
    got = await store.get(org, conversation.id)
    assert got.message_count == 0 and got.messages == [] and got.updated_at_ms == conversation.updated_at_ms
    # The key was not consumed: the corrected retry is stored, from seq 0.
    stored = await store.append(org, conversation.id, [NewMessage("user", "first")], "turn-1")
    assert [m.seq for m in stored] == [0]
    assert [m.content for m in (await store.get(org, conversation.id)).messages] == ["first"]


async def test_store_scopes_every_call_by_organization(store, org):
    conversation = await store.create(org, "t", "", {"a": "b"})
    other = org + "-other"
    for call in (store.get(other, conversation.id), store.delete(other, conversation.id),
                 store.append(other, conversation.id, [NewMessage("user", "x")], "k")):
        with pytest.raises(ConversationNotFound):
            await call
    assert await store.list(other, 10) == []
    assert (await store.get(org, conversation.id)).metadata == {"a": "b"}


async def test_migrations_applied_twice_are_a_no_op(store, org):
    conversation = await store.create(org, "kept", "", {})
    assert await store.migrate() == []
    assert await store.migrate() == []
    async with store.transaction(write=False) as tx:
        rows = await tx.fetch("SELECT version FROM conversations_schema_migrations ORDER BY version")
    assert [r["version"] for r in rows] == [m.version for m in migrations.load(store.dialect)]
    assert (await store.get(org, conversation.id)).title == "kept"


async def test_fresh_database_gets_every_migration_once(tmp_path):
    url = StoreConfig(url=f"sqlite:///{tmp_path}/fresh.db")
    first = await open_store(url)   # migrates on open
    try:
        assert await first.migrate() == []
        async with first.transaction(write=False) as tx:
            tables = {r["name"] for r in await tx.fetch("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert {"conversations", "conversation_messages", "conversation_appends", "conversations_schema_migrations"} <= tables
    finally:
        await first.close()


async def test_concurrent_starts_migrate_once(store_url):
    stores = await asyncio.gather(*(open_store(StoreConfig(url=store_url)) for _ in range(3)))
    try:
        assert [await s.migrate() for s in stores] == [[], [], []]
    finally:
        for s in stores:
            await s.close()


@pytest.mark.parametrize("url", ["mysql://x/y", "sqlite://relative.db", "conversations.db", ""])
async def test_unknown_store_url_is_refused(url):
    with pytest.raises(ValueError, match="store url must be"):
        await open_store(StoreConfig(url=url))


async def test_relative_sqlite_path_creates_its_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = await open_store(StoreConfig(url="sqlite:///./var/c.db"))
    await store.close()
    assert (tmp_path / "var" / "c.db").is_file()


def test_page_token_round_trip():
    cursor = Cursor(1_700_000_000_123, str(uuid.uuid4()))
    token = encode_page_token(cursor)
    assert decode_page_token(token) == cursor and cursor.id not in token


@pytest.mark.parametrize("token", ["", "v1", "%%%", encode_page_token(Cursor(1, str(uuid.uuid4())))[:-3] + "A"])
def test_malformed_page_tokens_are_value_errors(token):
    with pytest.raises(ValueError, match="page_token is malformed"):
        decode_page_token(token)


def test_config_from_environment():
    config = load_config(ConversationsConfig, None, "LLMSERVE_CONVERSATIONS", environ={
        "LLMSERVE_CONVERSATIONS__STORE__URL": "postgresql://postgres@db:5432/conversations",
        "LLMSERVE_CONVERSATIONS__SERVER__PORT": "6000",
        "LLMSERVE_CONVERSATIONS__LIMITS__MAX_CONTENT_BYTES": "2048"})
    assert config.store.url == "postgresql://postgres@db:5432/conversations"
    assert (config.server.port, config.server.metrics_port, config.limits.max_content_bytes) == (6000, 9160, 2048)
    assert ConversationsConfig().store.url == "sqlite:///./var/conversations.db"


async def test_cancelled_calls_leave_the_store_consistent(store, org):
    conversation = await store.create(org, "t", "", {})
    async with asyncio.timeout(30):   # a transaction left open shows up as a hang
        tasks = [asyncio.create_task(store.append(org, conversation.id, [NewMessage("user", str(i))] * 2, f"k{i}"))
                 for i in range(12)]
        for i, task in enumerate(tasks):   # cancel each at a different point of its transaction
            await asyncio.sleep(0.002 * (i % 4))
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await store.append(org, conversation.id, [NewMessage("user", "after")], "k-after")
        got = await store.get(org, conversation.id)
    assert [m.seq for m in got.messages] == list(range(got.message_count))
    assert got.message_count % 2 == 1 and got.messages[-1].content == "after"


async def test_two_stores_on_one_database_keep_seqs_contiguous(store_url, org):
    """Two service processes sharing one database: their appends interleave without gaps or repeats."""
    first, second = [await open_store(StoreConfig(url=store_url)) for _ in range(2)]
    try:
        conversation = await first.create(org, "t", "", {})
        await asyncio.gather(*((first, second)[i % 2].append(org, conversation.id, [NewMessage("user", str(i))] * 2,
                                                             f"k{i}") for i in range(10)))
        got = await second.get(org, conversation.id)
        assert [m.seq for m in got.messages] == list(range(20))
        assert sorted(m.content for m in got.messages) == sorted(str(i) for i in range(10) for _ in range(2))
    finally:
        await first.close()
        await second.close()

"""Conversations service configuration: YAML file plus LLMSERVE_CONVERSATIONS__SECTION__KEY overrides."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50060
    metrics_port: int = 9160           # Prometheus /metrics over HTTP; 0 disables
    grace_period_s: float = 5.0        # on SIGTERM: stop taking calls, finish running ones
    max_receive_message_bytes: int = 16 * 1024 * 1024


@dataclass
class StoreConfig:
    # sqlite:///relative/path.db, sqlite:////absolute/path.db, sqlite:///:memory:
    # or postgresql://user@host:5432/db
    url: str = "sqlite:///./var/conversations.db"
    pool_min_size: int = 1             # Postgres connections kept open
    pool_max_size: int = 10


@dataclass
class LimitsConfig:
    max_content_bytes: int = 1024 * 1024   # one message's content, UTF-8
    max_messages_per_append: int = 64
    max_title_chars: int = 512
    max_metadata_entries: int = 32
    max_metadata_bytes: int = 16 * 1024    # keys and values together, UTF-8
    max_id_chars: int = 255                # organization ids, idempotency keys, model names
    default_page_size: int = 20
    max_page_size: int = 100


@dataclass
class ConversationsConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)

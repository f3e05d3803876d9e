"""The conversations process: store, gRPC server with grpc.health.v1, and the metrics endpoint."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from urllib.parse import urlsplit

import asyncpg
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from llmserve.v1 import conversations_pb2, conversations_pb2_grpc

from .config import ConversationsConfig
from .metrics import Metrics
from .server import ConversationsServicer
from .store import ConversationStore, open_store

log = logging.getLogger(__name__)

SERVICE_NAME = conversations_pb2.DESCRIPTOR.services_by_name["Conversations"].full_name


class StoreUnavailable(RuntimeError):
    """The configured store cannot be opened or migrated."""


class ConversationsService:
    def __init__(self, config: ConversationsConfig):
        self.config = config
        self.port = 0                      # bound port once started (config port 0 picks a free one)
        self.store: ConversationStore | None = None
        self._metrics = Metrics()
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None

    async def start(self) -> int:
        server_config = self.config.server
        try:
            self.store = await open_store(self.config.store)
        except (OSError, ValueError, asyncio.TimeoutError, asyncpg.PostgresError, sqlite3.Error) as e:
            raise StoreUnavailable(f"cannot open the store {_redacted(self.config.store.url)}: {e}") from e
        self._server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", server_config.max_receive_message_bytes)])
        conversations_pb2_grpc.add_ConversationsServicer_to_server(
            ConversationsServicer(self.store, self.config.limits, self._metrics), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = self._server.add_insecure_port(f"{server_config.host}:{server_config.port}")
        await self._server.start()
        self._metrics.serve(server_config.host, server_config.metrics_port)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("conversations listening on %s:%d, store %s, metrics port %d", server_config.host,
                 self.port, _redacted(self.config.store.url), server_config.metrics_port)
        return self.port

    async def stop(self) -> None:
        """Reports NOT_SERVING, lets running calls finish within the grace period, closes the store."""
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(self.config.server.grace_period_s)
        self._metrics.close()
        if self.store is not None:
            await self.store.close()
        log.info("conversations stopped")


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url

"""The gateway application: its parts (built once from the config and passed down) and routes."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Coroutine

from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider

from services.gateway.auth import Authenticator, hash_key, hint_of
from services.gateway.config import GatewayConfig
from services.gateway.conversations_client import ConversationsClient
from services.gateway.errors import error_middleware
from services.gateway.metering import Metering
from services.gateway.metrics import GatewayMetrics
from services.gateway.overload import OverloadGuard
from services.gateway.pool_watch import PoolWatch
from services.gateway.replicas import make_replicas
from services.gateway.ratelimit import RateLimiter, make_rate_limiter
from services.gateway.request_context import REQUEST_ID
from services.gateway.safety.policy import load_safety_policy
from services.gateway.store import Store, open_store
from services.gateway.tracing import make_tracer_provider
from services.gateway.upstream import Upstream

log = logging.getLogger(__name__)
_REQUEST_ID = re.compile(r"^[\w.:-]{1,128}$")


@dataclass
class Gateway:
    config: GatewayConfig
    store: Store
    auth: Authenticator
    limiter: RateLimiter
    safety: Any
    upstream: Upstream
    conversations: ConversationsClient
    overload: OverloadGuard
    metering: Metering
    metrics: GatewayMetrics
    tracer_provider: TracerProvider
    background: set[asyncio.Task] = field(default_factory=set)
    started_at: int = field(default_factory=lambda: int(time.time()))
    pool_watch: PoolWatch | None = None   # feeds the overload guard when its limit follows the pool

    @cached_property
    def tracer(self):   # get_tracer builds a new tracer each call
        return self.tracer_provider.get_tracer("llmserve.gateway")

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """Runs bookkeeping that must finish even when the request's task is cancelled."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def drain(self) -> None:
        while self.background:
            await asyncio.gather(*list(self.background), return_exceptions=True)


GATEWAY = web.AppKey("gateway", Gateway)


async def open_gateway(cfg: GatewayConfig, tracer_provider: TracerProvider | None = None) -> Gateway:
    store = await open_store(cfg.database.url)
    metrics = GatewayMetrics()
    limiter = make_rate_limiter(cfg.rate_limit)
    gw = Gateway(config=cfg, store=store, auth=Authenticator(store, cfg.auth.admin_token, cfg.auth.cache_ttl_s),
                 limiter=limiter, safety=load_safety_policy(cfg.safety.policy_file or None),
                 upstream=Upstream(cfg.upstream), conversations=ConversationsClient(cfg.conversations),
                 overload=OverloadGuard(cfg.overload, metrics), metering=Metering(store, limiter, metrics),
                 metrics=metrics, tracer_provider=tracer_provider or make_tracer_provider(cfg.tracing))
    if cfg.local_mode.enabled:
        await ensure_dev_key(store, cfg.local_mode.organization, cfg.local_mode.api_key)
    if cfg.overload.max_in_flight_per_worker > 0 or cfg.overload.follow_pool_load:
        replicas = make_replicas(cfg.rate_limit, beat_s=cfg.overload.workers_poll_s)
        gw.pool_watch = PoolWatch(gw.upstream, gw.overload, replicas, cfg.overload.workers_poll_s)
        gw.pool_watch.start()
    return gw


async def close_gateway(gw: Gateway) -> None:
    if gw.pool_watch is not None:
        await gw.pool_watch.close()
    await gw.drain()
    await gw.upstream.close()
    await gw.conversations.close()
    await gw.limiter.close()
    await gw.store.close()


async def ensure_dev_key(store: Store, org_name: str, secret: str) -> None:
    """Local mode: one dev organization (no limits) holding the dev key; idempotent across restarts."""
    if await store.find_key(hash_key(secret)):
        return
    org = await store.find_organization_by_name(org_name) or await store.create_organization(org_name)
    await store.create_key(org.id, "local dev key", hash_key(secret), hint_of(secret))
    log.info("local mode: dev key %s for organization %s", hint_of(secret), org.id)


@web.middleware
async def request_context(request: web.Request, handler):
    """Request id (the caller's if sane), and requests counted by route and final status."""
    incoming = request.headers.get("x-request-id", "")
    request["request_id"] = incoming if _REQUEST_ID.match(incoming) else "req_" + secrets.token_hex(12)
    REQUEST_ID.set(request["request_id"])
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    status = "499"
    try:
        response = await handler(request)
        status = str(response.status)
        return response
    finally:
        request.app[GATEWAY].metrics.requests.labels(route=route, status=status).inc()


async def _add_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["x-request-id"] = request.get("request_id", "")
    for name, value in request.get("ratelimit_headers", {}).items():
        response.headers.setdefault(name, value)


def build_app(cfg: GatewayConfig, tracer_provider: TracerProvider | None = None) -> web.Application:
    from services.gateway.routes import register_routes

    app = web.Application(client_max_size=cfg.server.max_body_bytes,
                          middlewares=[request_context, error_middleware])

    async def lifecycle(app: web.Application):
        app[GATEWAY] = await open_gateway(cfg, tracer_provider)
        yield
        await close_gateway(app[GATEWAY])

    app.cleanup_ctx.append(lifecycle)
    app.on_response_prepare.append(_add_headers)
    register_routes(app)
    return app

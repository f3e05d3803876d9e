"""The chat page at / (built from services/gateway/web into static/), what the page needs to know of
this gateway (/chat/config), its static files, health and Prometheus /metrics."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.gateway.app import GATEWAY

STATIC = Path(__file__).resolve().parent.parent / "static"


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


async def chat_config(request: web.Request) -> web.Response:
    """Local mode (make run) hands the page its development key; production never has one to give."""
    local = request.app[GATEWAY].config.local_mode
    return web.json_response({"dev_api_key": local.api_key if local.enabled else None})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    """This app's registry, plus the process-wide one (the rate limiter counts there)."""
    body = generate_latest(request.app[GATEWAY].metrics.registry) + generate_latest(REGISTRY)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def register(app: web.Application) -> None:
    app.router.add_get("/", index)
    app.router.add_get("/chat/config", chat_config)
    app.router.add_get("/healthz", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_static("/static/", STATIC)

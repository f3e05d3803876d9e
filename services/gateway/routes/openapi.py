"""The OpenAPI 3.1 document (openapi.yaml beside the package), served as JSON."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml
from aiohttp import web

DOCUMENT = Path(__file__).resolve().parent.parent / "openapi.yaml"


@lru_cache(maxsize=1)
def openapi_document() -> dict:
    return yaml.safe_load(DOCUMENT.read_text())


async def serve(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


def register(app: web.Application) -> None:
    app.router.add_get("/openapi.json", serve)
    app.router.add_get("/v1/openapi.json", serve)

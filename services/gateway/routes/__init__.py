"""HTTP routes. Each module registers its own; handlers raise ApiError for every refusal."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from services.gateway.errors import ApiError, invalid


async def read_json(request: web.Request) -> Any:
    """The body as JSON; 413 past the size limit (aiohttp raises it while reading), 400 if malformed."""
    raw = await request.read()
    if not raw:
        raise invalid("the request body is empty; expected JSON", None, "invalid_json")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def register_routes(app: web.Application) -> None:
    from services.gateway.routes import admin, chat, completions, conversations, embeddings, models, openapi, \
        pages, responses

    for module in (chat, completions, responses, embeddings, models, conversations, admin, openapi, pages):
        module.register(app)

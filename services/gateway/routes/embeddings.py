"""POST /v1/embeddings: served only by models with an embedding (pooling) head. No model family
the workers load has one yet (ModelInfo.embeddings is false), so the answer is a 400 saying why."""

from __future__ import annotations

from aiohttp import web

from services.gateway.chat_request import parse_model
from services.gateway.errors import ApiError, invalid
from services.gateway.pipeline import Pipeline
from services.gateway.routes import read_json


async def embeddings(request: web.Request) -> web.Response:
    pipeline = await Pipeline.open(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    model = parse_model(body)
    info = await pipeline.gw.upstream.model(model)
    if not info.embeddings:
        raise invalid(f"the model `{model}` has no embedding head: it is served for generation only, and no "
                      "served model computes embeddings", "model", "model_not_supported")
    raise ApiError(501, f"the model `{model}` reports an embedding head, but this gateway has no embedding "
                   "path to it yet", code="not_implemented", type="server_error")


def register(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)

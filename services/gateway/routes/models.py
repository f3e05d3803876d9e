"""GET /v1/models and /v1/models/{id}, from the upstream's ListModels."""

from __future__ import annotations

from aiohttp import web

from llmserve.v1 import worker_pb2
from services.gateway.app import GATEWAY


def model_object(info: worker_pb2.ModelInfo, created: int) -> dict:
    return {"id": info.name, "object": "model", "created": created, "owned_by": info.owned_by or "llmserve",
            "max_context_length": info.max_context_length}


async def list_models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    await gw.auth.principal(request)
    models = await gw.upstream.models()
    created = gw.started_at
    return web.json_response({"object": "list", "data": [model_object(m, created) for m in models.values()]})


async def get_model(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    await gw.auth.principal(request)
    info = await gw.upstream.model(request.match_info["model"])
    return web.json_response(model_object(info, gw.started_at))


def register(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)

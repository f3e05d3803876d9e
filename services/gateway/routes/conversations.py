"""Conversations of the caller's organization: POST/GET /v1/conversations, GET/POST/DELETE
/v1/conversations/{id}. A chat completion with "conversation_id" resumes one (see chat.py).

POST /v1/conversations/{id} updates: a new title (rename), model or metadata (the chat page keeps a
conversation's generation settings there), and keep_messages, which drops the messages from that
position on, so that a regenerated answer or an edited message replaces what followed."""

from __future__ import annotations

from aiohttp import web

from llmserve.v1 import conversations_pb2 as pb
from services.gateway.app import GATEWAY
from services.gateway.errors import invalid
from services.gateway.routes import read_json

MAX_TITLE = 256
MAX_METADATA = 16


def message_object(m: pb.StoredMessage) -> dict:
    return {"id": m.id, "object": "conversation.message", "role": m.role, "content": m.content,
            "created_at": m.created_at_ms // 1000, "partial": m.partial, "model": m.model or None, "seq": m.seq}


def conversation_object(c: pb.Conversation, with_messages: bool = False) -> dict:
    body = {"id": c.id, "object": "conversation", "title": c.title, "model": c.model or None,
            "created_at": c.created_at_ms // 1000, "updated_at": c.updated_at_ms // 1000,
            "metadata": dict(c.metadata), "message_count": c.message_count}
    if with_messages:
        body["messages"] = [message_object(m) for m in c.messages]
    return body


def _optional_string(body: dict, name: str, limit: int) -> str:
    value = body.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise invalid(f"{name} must be a string", name, "invalid_type")
    if len(value) > limit:
        raise invalid(f"{name} is longer than {limit} characters", name, "invalid_value")
    return value


async def _body(request: web.Request, allowed: set[str], required: bool) -> dict:
    body = await read_json(request) if required or request.can_read_body else {}
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(f"unrecognized request argument: {unknown[0]}", unknown[0], "unknown_parameter")
    return body


def _metadata(body: dict) -> dict[str, str] | None:
    """None when the body has no metadata (or null)."""
    metadata = body.get("metadata")
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items()):
        raise invalid(f"metadata must map up to {MAX_METADATA} strings to strings", "metadata", "invalid_value")
    return metadata


async def _model(gw, body: dict) -> str | None:
    """The model named in the body, once the upstream knows it (404 otherwise); None when absent."""
    if body.get("model") is None:
        return None
    model = _optional_string(body, "model", MAX_TITLE)
    if model:
        await gw.upstream.model(model)
    return model


async def create_conversation(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    principal = await gw.auth.principal(request)
    body = await _body(request, {"title", "model", "metadata"}, required=False)
    model = await _model(gw, body)
    conversation = await gw.conversations.create(principal.organization.id, _optional_string(body, "title", MAX_TITLE),
                                                 model or "", _metadata(body) or {})
    return web.json_response(conversation_object(conversation), status=201)


async def list_conversations(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    principal = await gw.auth.principal(request)
    raw_limit = request.query.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise invalid("limit must be an integer in [1, 100]", "limit", "invalid_value")
    page = await gw.conversations.list(principal.organization.id, int(raw_limit), request.query.get("after", ""))
    return web.json_response({"object": "list", "data": [conversation_object(c) for c in page.conversations],
                              "has_more": bool(page.next_page_token),
                              "next_page_token": page.next_page_token or None})


async def get_conversation(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    principal = await gw.auth.principal(request)
    conversation = await gw.conversations.get_chat(principal.organization.id, request.match_info["id"])
    return web.json_response(conversation_object(conversation, with_messages=True))


async def update_conversation(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    principal = await gw.auth.principal(request)
    body = await _body(request, {"title", "model", "metadata", "keep_messages"}, required=True)
    keep = body.get("keep_messages")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep < 2 ** 32):
        raise invalid("keep_messages must be a non-negative integer", "keep_messages", "invalid_value")
    title = _optional_string(body, "title", MAX_TITLE) if body.get("title") is not None else None
    model = await _model(gw, body)
    metadata = _metadata(body)
    if title is None and model is None and metadata is None and keep is None:
        raise invalid("nothing to update: give title, model, metadata or keep_messages", None, "invalid_value")
    await gw.conversations.get_chat(principal.organization.id, request.match_info["id"])
    conversation = await gw.conversations.update(principal.organization.id, request.match_info["id"], title, model,
                                                 metadata, keep)
    return web.json_response(conversation_object(conversation))


async def delete_conversation(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    principal = await gw.auth.principal(request)
    conversation_id = request.match_info["id"]
    await gw.conversations.get_chat(principal.organization.id, conversation_id)
    await gw.conversations.delete(principal.organization.id, conversation_id)
    return web.json_response({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


def register(app: web.Application) -> None:
    app.router.add_post("/v1/conversations", create_conversation)
    app.router.add_get("/v1/conversations", list_conversations)
    app.router.add_get("/v1/conversations/{id}", get_conversation)
    app.router.add_post("/v1/conversations/{id}", update_conversation)
    app.router.add_delete("/v1/conversations/{id}", delete_conversation)

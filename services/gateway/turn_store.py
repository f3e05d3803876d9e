"""A chat turn's conversation write is never lost silently.

ConversationsClient.append retries it under the same idempotency key (stored once by the service);
a write that still fails is counted in llmserve_gateway_conversation_store_failures_total, logged
with the request id, and returned as ConversationNotStored for the client to be told: a 503 instead
of a whole response, an SSE error event before [DONE] on a stream.
"""

from __future__ import annotations

import logging

from llmserve.v1 import conversations_pb2
from services.gateway.app import Gateway
from services.gateway.errors import ApiError
from services.gateway.request_context import REQUEST_ID

log = logging.getLogger(__name__)


class ConversationNotStored(ApiError):
    """The reply was generated but the conversation does not hold this turn."""


async def store_turn(gw: Gateway, org_id: str, conversation_id: str, messages: list[conversations_pb2.NewMessage],
                     idempotency_key: str) -> ConversationNotStored | None:
    """Never raises ApiError (it runs as a background task that nobody may await)."""
    try:
        await gw.conversations.append(org_id, conversation_id, messages, idempotency_key)
        return None
    except ApiError as e:
        gw.metrics.conversation_store_failures.labels(code=e.code or str(e.status)).inc()
        log.error("request %s: turn %s NOT stored in conversation %s: %s", REQUEST_ID.get(), idempotency_key,
                  conversation_id, e.message)
        return ConversationNotStored(
            503 if e.status >= 500 else e.status,
            f"this turn was not stored in conversation `{conversation_id}`: {e.message}",
            param="conversation_id", code="conversation_not_stored", headers={"Retry-After": "1"})

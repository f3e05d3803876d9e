"""The id of the request being served, for log lines written below the handler (gRPC clients,
bookkeeping). Set by app.request_context in the request's task; tasks spawned from it inherit it."""

from __future__ import annotations

from contextvars import ContextVar

REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="-")

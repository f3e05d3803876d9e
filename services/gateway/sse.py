"""Server-sent events exactly as the openai SDK parses them: `data: <json>\\n\\n`, comments for
keep-alive, `data: [DONE]` last."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, TypeVar

from aiohttp import web

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
KEEPALIVE = object()  # yielded by with_keepalive when nothing arrived for a while

_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no"}


class EventStream:
    """Events are queued, then written together by the next send(): what one upstream message
    produced goes out in one transport write, at once (never held for a later message)."""

    def __init__(self, request: web.Request):
        self._request = request
        self._queued: list[bytes] = []
        self.response = web.StreamResponse(status=200, headers=_HEADERS)

    @property
    def started(self) -> bool:
        """Events were written or queued: from here a failure can only be sent as an error event."""
        return self.response.prepared or bool(self._queued)

    async def start(self) -> None:
        if not self.response.prepared:
            await self.response.prepare(self._request)

    def queue(self, data: bytes) -> None:
        """Whole encoded events (Completion.chunk) for the next send()."""
        self._queued.append(data)

    def queue_all(self, events: list[bytes]) -> None:
        self._queued.extend(events)

    def _take(self, data: bytes) -> bytes:
        if self._queued:
            data = b"".join((*self._queued, data))
            self._queued.clear()
        return data

    async def send(self, data: bytes = b"") -> None:
        """Writes the queued events and `data` (whole events) now."""
        await self.start()
        data = self._take(data)
        if data:
            await self.response.write(data)

    async def keepalive(self) -> None:
        await self.send(b": keep-alive\n\n")

    async def done(self, last: bytes = DONE) -> None:
        """Ends the stream, `last` (the [DONE] event, or b"" where the format has none) after the queued events."""
        await self.start()
        await self.response.write_eof(self._take(last))


async def with_keepalive(items: AsyncIterator[T], interval_s: float) -> AsyncIterator[Any]:
    """Yields the items, and KEEPALIVE whenever none arrived for interval_s before the first one
    (after that the stream is flowing and writes reveal a dead client). The pending read is never
    cancelled by the timer: cancelling a gRPC read would cancel the call."""
    iterator = items.__aiter__()
    first = asyncio.ensure_future(iterator.__anext__())
    try:
        while not first.done():
            done, _ = await asyncio.wait({first}, timeout=interval_s)
            if not done:
                yield KEEPALIVE
        try:
            item = first.result()
        except StopAsyncIteration:
            return
    finally:
        if not first.done():
            first.cancel()
    yield item
    async for item in iterator:
        yield item

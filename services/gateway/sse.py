"""Server-sent events exactly as the openai SDK parses them: `data: <json>\\n\\n`, comments for
keep-alive, `data: [DONE]` last."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, TypeVar

from aiohttp import web

T = TypeVar("T")
KEEPALIVE = object()  # yielded by with_keepalive when nothing arrived for a while

_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no"}


def encode(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class EventStream:
    def __init__(self, request: web.Request):
        self._request = request
        self.response = web.StreamResponse(status=200, headers=_HEADERS)

    @property
    def started(self) -> bool:
        return self.response.prepared

    async def start(self) -> None:
        if not self.response.prepared:
            await self.response.prepare(self._request)

    async def send(self, obj: Any) -> None:
        await self.start()
        await self.response.write(encode(obj))

    async def send_raw(self, data: bytes) -> None:
        await self.start()
        await self.response.write(data)

    async def keepalive(self) -> None:
        await self.send_raw(b": keep-alive\n\n")

    async def done(self) -> None:
        await self.send_raw(b"data: [DONE]\n\n")
        await self.response.write_eof()


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

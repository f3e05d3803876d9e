"""A caller's view of one request: its outputs, from the queue its engine feeds, until every choice
has finished. Shared by the in-thread engine (async_engine.py) and the engine-core client
(core_client.py), which differ only in how outputs arrive and how a request is aborted."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from services.worker.engine.output_processor import RequestOutput


async def outputs_until_finished(outputs: asyncio.Queue, num_choices: int,
                                 abort: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """Yields what arrives until num_choices outputs have finished; an exception that arrives is
    raised (the engine refused the request or is gone: nothing to abort). A caller that leaves
    early (cancelled) has abort() called, so the engine frees the request at its next step."""
    remaining = num_choices
    try:
        while remaining:
            item = await outputs.get()
            if isinstance(item, Exception):
                remaining = 0
                raise item
            if item.finished:
                remaining -= 1
            yield item
    finally:
        if remaining:
            abort()

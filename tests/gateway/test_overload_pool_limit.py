"""The overload guard's limit as the pool changes (in process; the real router and workers are in
tests/reliability/test_overload_follows_pool.py): per-worker budget x routable workers within the
floor and ceiling, queued requests admitted as soon as the limit rises, admitted ones kept when it
falls, and no slot lost to a waiter that gives up."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.gateway.config import OverloadConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.overload import OverloadGuard, Overloaded


def guard(**cfg) -> OverloadGuard:
    return OverloadGuard(OverloadConfig(**{"max_in_flight_per_worker": 2, "min_in_flight_per_model": 1,
                                           "max_in_flight_per_model": 5, "max_queued_per_model": 4,
                                           "queue_timeout_s": 2.0, **cfg}), GatewayMetrics())


def test_the_limit_is_the_budget_times_the_workers_within_floor_and_ceiling():
    g = guard()
    for workers, limit in ((0, 1), (1, 2), (2, 4), (3, 5), (10, 5)):
        g.set_workers({"m": workers})
        assert g.limit("m") == limit
    assert g.limit("unlisted") == 1
    g.set_workers({}, default=1)                 # the upstream is one worker
    assert g.limit("any") == 2
    assert guard(max_in_flight_per_worker=0).limit("m") == 5   # fixed


async def test_queued_requests_follow_the_limit_up_and_admitted_ones_survive_it_going_down():
    g = guard(queue_timeout_s=0.5)
    g.set_workers({"m": 1})
    async with contextlib.AsyncExitStack() as held:
        for _ in range(2):
            await held.enter_async_context(g.admit("m"))
        waiter = asyncio.create_task(held.enter_async_context(g.admit("m")))
        await asyncio.sleep(0.05)
        assert not waiter.done()                 # queued behind the two
        g.set_workers({"m": 2})
        await asyncio.wait_for(waiter, 1)        # admitted as soon as the limit rose
        g.set_workers({"m": 0})                  # three stay in flight; a newcomer waits, then gives up
        with pytest.raises(Overloaded, match="queue timeout"):
            async with g.admit("m"):
                pass
    g.set_workers({"m": 2})                       # all left: the full limit is free again
    async with contextlib.AsyncExitStack() as held:
        for _ in range(4):
            await asyncio.wait_for(held.enter_async_context(g.admit("m")), 1)


async def test_a_waiter_that_leaves_the_queue_takes_no_slot():
    g = guard(queue_timeout_s=5.0)
    g.set_workers({"m": 0})                       # limit 1
    holder = contextlib.AsyncExitStack()
    await holder.enter_async_context(g.admit("m"))
    first = asyncio.create_task(g.admit("m").__aenter__())
    second = asyncio.create_task(g.admit("m").__aenter__())
    await asyncio.sleep(0.05)
    first.cancel()                                # its client went away while it waited
    with pytest.raises(asyncio.CancelledError):
        await first
    await holder.aclose()
    await asyncio.wait_for(second, 1)             # the freed slot went to the next in line

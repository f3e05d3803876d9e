"""A waiter's wait read off the in-flight streams (services/gateway/admission/slot_release.py),
through the real OverloadGuard on a virtual clock: the n-th slot to free is the n-th smallest
remaining time of the streams in flight, not n x hold / limit. A light organization finding every
slot taken is queued, not refused, and admitted at the next release ahead of the flood's waiters;
streams left above a limit that fell do not use up the spare slot it may take; a request whose
wait is past its bound is refused at once with the release it would have waited for as
Retry-After."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

from services.gateway.admission.fair_queue import FairQueue, Waiter
from services.gateway.config import OverloadConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.overload import OverloadGuard, Overloaded
from tests.gateway.admission_helpers import VirtualClock, report


def guard(clock: VirtualClock, **cfg) -> OverloadGuard:
    return OverloadGuard(OverloadConfig(**{"follow_pool_load": False, "min_in_flight_per_model": 1,
                                           "max_in_flight_per_model": 64, "max_queued_per_model": 64,
                                           "queue_timeout_s": 30.0, "ttft_target_s": 1.0, **cfg}),
                         GatewayMetrics(), clock=clock)


async def measure_one_second_a_token(g: OverloadGuard, clock: VirtualClock, org: str) -> None:
    """A stream of 100 tokens held its slot 100 s: the model's streams take 1 s a budgeted token."""
    async with g.admit("m", org=org, prompt_tokens=50, max_tokens=100):
        clock.t += 100


async def hold(g: OverloadGuard, org: str, max_tokens: int):
    cm = g.admit("m", org=org, prompt_tokens=50, max_tokens=max_tokens)
    await cm.__aenter__()
    return cm


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def decisions(g: OverloadGuard, org: str, decision: str) -> float:
    return g.metrics.decisions.labels(model="m", organization=org, decision=decision)._value.get()


async def test_a_light_organization_finding_every_slot_taken_waits_for_the_next_release_and_goes_first():
    clock = VirtualClock()
    g = guard(clock, max_in_flight_per_model=4)              # 4 slots and one spare past them
    await measure_one_second_a_token(g, clock, "flood")
    t0 = clock.t
    flood = []
    for at in (0, 5, 60, 70):                                # they free at t0 + 90, 95, 150 and 160
        clock.t = t0 + at
        flood.append(await hold(g, "flood", 90))
    clock.t = t0 + 71
    other = await hold(g, "other", 100)                      # another light organization: the spare slot
    clock.t = t0 + 72
    flood_waiter = asyncio.create_task(hold(g, "flood", 90))
    await settle()
    clock.t = t0 + 73
    light = asyncio.create_task(hold(g, "light", 4))
    await settle()
    # The fluid estimate said 90 s / 4 slots x 2 in line = 45 s, past the 30 s bound, and refused it.
    assert not light.done() and not flood_waiter.done()
    assert decisions(g, "light", "queued") == 1 and decisions(g, "light", "refused") == 0
    assert g.estimated_wait_s("m", 0, "light") == pytest.approx(17.0)    # the first release, at t0 + 90

    clock.t = t0 + 90
    await flood[0].__aexit__(None, None, None)
    await settle()
    assert light.done() and not flood_waiter.done()          # first at the next release, ahead of the flood
    clock.t = t0 + 94
    await light.result().__aexit__(None, None, None)         # its 4 tokens streamed
    await settle()
    assert not flood_waiter.done()                           # the flood is back at the limit
    clock.t = t0 + 95
    await flood[1].__aexit__(None, None, None)
    await asyncio.wait_for(flood_waiter, 1)                  # then the flood's waiter, within its 30 s
    for cm in (flood_waiter.result(), other, *flood[2:]):
        await cm.__aexit__(None, None, None)
    assert decisions(g, "flood", "refused") == 0


async def test_streams_left_above_a_limit_that_fell_do_not_use_up_the_spare_slot():
    clock = VirtualClock()
    g = guard(clock, max_in_flight_per_worker=1)
    g.set_workers({"m": 3})
    await measure_one_second_a_token(g, clock, "flood")
    async with contextlib.AsyncExitStack() as held:
        for _ in range(3):
            await held.enter_async_context(g.admit("m", org="flood", max_tokens=90))
            clock.t += 20
        g.set_workers({"m": 2})      # the limit falls to 2 under the flood's 3 streams (limit + spare)
        # Before, the light organization had to wait for one of the three to end: the fluid estimate
        # (90 s / 2 slots = 45 s) refused it. The spare slot is still unused: it is admitted at once.
        await asyncio.wait_for(held.enter_async_context(g.admit("m", org="light", max_tokens=16)), 1)
        assert decisions(g, "light", "admitted") == 1
        # The spare taken, a second one waits for the first stream to end: the light one's 16 tokens,
        # before the flood's first (in 90 - 60 = 30 s).
        assert g.estimated_wait_s("m", 0, "second-light") == pytest.approx(16.0)


async def test_each_waiter_is_admitted_at_the_release_its_turn_needs_replayed_on_the_streams_in_flight():
    clock = VirtualClock()
    g = guard(clock, max_in_flight_per_model=4, burst_share=0.0)   # every queue may be a burst's: the long bound
    await measure_one_second_a_token(g, clock, "A")
    now = clock.t + 20
    async with contextlib.AsyncExitStack() as held:
        for admitted, budget in ((now - 18, 30), (now - 15, 20), (now - 10, 60), (now - 10, 35)):
            clock.t = admitted
            await held.enter_async_context(g.admit("m", org="A", max_tokens=budget))
        clock.t = now                                        # they free their slots in 12, 5, 50 and 25 s
        waiters = []
        for budget in (10, 100, 100, 100):
            waiters.append(asyncio.create_task(hold(g, "A", budget)))
            await settle()
        assert not any(w.done() for w in waiters)            # all four within the 30 s bound
        waits = [g.estimated_wait_s("m", k, "A") for k in range(5)]
        # The first waiter takes the slot freed in 5 s and streams 10 tokens, so the third takes
        # that one again at 15 s, before the stream that ends at 25 s. The fluid (k + 1) x hold / 4
        # said 25, 50, 75, 100 s (a mean hold of 100 s).
        assert waits == pytest.approx([5.0, 12.0, 15.0, 25.0, 50.0])
        assert g.estimated_wait_s("m", 0, "B") == 0.0        # nothing in flight: a spare slot is free
        assert g.estimated_wait_s("m", 4, "B") == pytest.approx(25.0)   # behind A's four: fits at once then
        clock.t = now + 40                                   # three streams overdue: they end any moment
        assert g.estimated_wait_s("m", 0, "A") == 0.0
        assert g.estimated_wait_s("m", 3, "A") == pytest.approx(10.0)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)


async def test_before_any_stream_ended_the_releases_come_from_the_pools_estimates_at_admission():
    clock = VirtualClock()
    g = guard(clock, follow_pool_load=True, max_in_flight_per_model=3, stream_tokens_per_s=1.0)
    g.set_pool({"m": [report()]})                            # about 2 tokens/s a stream
    async with contextlib.AsyncExitStack() as held:
        ends = []
        for budget in (100, 40, 70):
            ticket = await held.enter_async_context(g.admit("m", org="A", prompt_tokens=10, max_tokens=budget))
            ends.append(ticket.admitted_at + ticket.estimate.ttft_s + budget / ticket.estimate.tokens_per_s)
            clock.t += 1
        wait = g.estimated_wait_s("m", 0, "A")
        assert wait == pytest.approx(min(ends) - clock.t)     # the 40-token stream's end, in about 19 s
        assert 15 < wait < 22


async def test_a_request_whose_next_release_is_past_its_bound_is_refused_at_once_and_told_when_it_would_wait_half_of_it():
    clock = VirtualClock()
    g = guard(clock, max_in_flight_per_model=4, queue_timeout_s=30)
    await measure_one_second_a_token(g, clock, "A")
    async with contextlib.AsyncExitStack() as held:
        for budget in (40, 45, 50, 60):
            await held.enter_async_context(g.admit("m", org="A", max_tokens=budget))
        with pytest.raises(Overloaded) as refused:           # the fluid 100 s / 4 = 25 s queued it
            await asyncio.wait_for(held.enter_async_context(g.admit("m", org="A")), 1)
        assert refused.value.status == 429 and "estimated wait 40.0s" in refused.value.message
        assert refused.value.headers["Retry-After"] == "25" and refused.value.headers["retry-after-ms"] == "25000"  # 40 - 30 / 2
        await held.enter_async_context(g.admit("m", org="B"))   # nothing in flight: the spare slot
        clock.t += 5
        with pytest.raises(Overloaded) as refused:           # every slot, the spare too: the first frees in 35 s
            await asyncio.wait_for(held.enter_async_context(g.admit("m", org="C", max_tokens=16)), 1)
        assert refused.value.headers["Retry-After"] == "20"    # 35 - 30 / 2


async def test_on_equal_counters_the_organization_holding_fewer_slots_goes_first():
    q = FairQueue()
    for _ in range(3):                               # the flood holds three slots
        q.join("flood")
        q.charge("flood", 100.0, 1.0)
    q.join("flood")
    q.push(flood := Waiter("flood", 1.0, 0, 100.0))
    q.join("light")                                  # lifted to the flood's counter: a tie
    q.push(light := Waiter("light", 1.0, 0, 20.0))
    assert q.counter("light") == q.counter("flood")
    assert q.ordered() == [light, flood] and q.peek() is light   # by arrival alone the flood's went first


async def test_beside_a_flood_under_a_moving_limit_a_light_organization_is_never_refused():
    """bench-load's first fairness phase on a virtual clock (1 tick = 1 s): 24 clients of one
    organization stream answers of 16-160 tokens at 1 token/s and honour Retry-After; a second sends
    16-token requests one at a time and retries 1 s after a refusal; the pool's limit moves between
    2 and 5 every 30 s, as the workers' reports moved it in the last session's run (2-5 streams of
    10-90 s, where it was refused 498 of 526 times). With the slot releases but the spare slot
    shared with streams left above a fallen limit: 154 of its 311 attempts were refused."""
    clock, ticks_total = VirtualClock(), 3000
    g = guard(clock, max_in_flight_per_worker=1, max_queued_per_model=32, ttft_target_s=2.0)
    g.set_workers({"m": 3})
    rng = random.Random(1)
    lengths = [rng.randint(16, 160) for _ in range(64)]
    start = clock.t
    tick = asyncio.Condition()
    seen = dict(light_refused=0, light_served=0, light_waits=[], flood_served=0)

    async def ticks(n: int) -> None:
        end = clock.t + n
        async with tick:
            await tick.wait_for(lambda: clock.t >= end or clock.t - start >= ticks_total)

    async def flood(i: int) -> None:
        while clock.t - start < ticks_total:
            try:
                async with g.admit("m", org="flood", prompt_tokens=100, max_tokens=lengths[i % 64]):
                    await ticks(lengths[i % 64])
                seen["flood_served"] += 1
            except Overloaded as e:
                await ticks(max(1, min(60, int(e.headers["Retry-After"]))))
            i += 24

    async def light() -> None:
        await ticks(60)                                     # the flood fills the pool first
        while clock.t - start < ticks_total:
            asked = clock.t
            try:
                async with g.admit("m", org="light", prompt_tokens=30, max_tokens=16):
                    seen["light_waits"].append(clock.t - asked)
                    await ticks(16)
                seen["light_served"] += 1
            except Overloaded:
                seen["light_refused"] += 1
                await ticks(1)

    tasks = [asyncio.create_task(flood(i)) for i in range(24)] + [asyncio.create_task(light())]
    limits = random.Random(5)
    for t in range(ticks_total):
        if t % 30 == 0:
            g.set_workers({"m": limits.randint(2, 5)})
        for _ in range(30):                                 # every stream reaches its next wait
            await asyncio.sleep(0)
        async with tick:
            clock.t += 1
            tick.notify_all()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert seen["light_refused"] == 0, seen["light_refused"]
    assert seen["light_served"] >= (ticks_total - 60) // 17 - 2 and max(seen["light_waits"]) == 0
    assert seen["flood_served"] >= 100                      # the flood kept the slots busy (~3.5 x 3000 / 88)


async def test_a_short_answers_wait_for_its_first_token_is_not_charged_to_every_token_of_a_long_one():
    clock = VirtualClock()
    g = guard(clock, max_in_flight_per_model=1)
    for _ in range(3):                  # short answers: 5 s to the first token, then 3 tokens in 0.3 s
        async with g.admit("m", org="A", prompt_tokens=50, max_tokens=3) as ticket:
            clock.t += 5.0
            ticket.first_token()
            clock.t += 0.3
    long = g.admit("m", org="A", prompt_tokens=50, max_tokens=100)
    ticket = await long.__aenter__()
    clock.t += 5.0
    ticket.first_token()                # the long one's first token is out: 100 tokens at 0.1 s to go
    clock.t += 2.0
    # Its slot frees 8 s from now (first token + 100 x 0.1 s), not at grant + 100 x 5.3 / 3 s (169 s).
    assert g.estimated_wait_s("m", 0, "A") == pytest.approx(8.0, abs=0.01)
    await long.__aexit__(None, None, None)


async def stream(ticket, clock: VirtualClock, tokens: int, s_per_token: float) -> None:
    """The first token now, then tokens - 1 more at s_per_token each, each reported as streamed."""
    ticket.first_token()
    ticket.progress(1)
    for n in range(2, tokens + 1):
        clock.t += s_per_token
        ticket.progress(n)


async def test_a_stream_slower_than_the_ended_ones_frees_its_slot_at_its_own_pace_not_any_moment():
    clock = VirtualClock()
    g = guard(clock, max_in_flight_per_model=1)
    async with g.admit("m", org="A", prompt_tokens=50, max_tokens=10) as ticket:   # 0.1 s a token, alone
        await stream(ticket, clock, 10, 0.1)
    heavy = g.admit("m", org="A", prompt_tokens=50, max_tokens=100)
    ticket = await heavy.__aenter__()
    await stream(ticket, clock, 40, 0.5)   # a heavier batch: 0.5 s a token, 39 x 0.5 s past its first token
    # From the means it was due 10 s after its first token (100 x 0.1 s), overdue since 9.5 s; its
    # own pace leaves 60 tokens x 0.5 s.
    assert g.estimated_wait_s("m", 0, "A") == pytest.approx(30.0, abs=0.01)
    await heavy.__aexit__(None, None, None)


async def test_a_streams_remaining_budget_is_scaled_by_the_share_the_ended_streams_used():
    clock = VirtualClock()
    g = guard(clock, max_in_flight_per_model=1)
    for _ in range(3):                     # answers that stop at 11 of their budget of 20, 0.1 s a token
        async with g.admit("m", org="A", prompt_tokens=50, max_tokens=20) as ticket:
            await stream(ticket, clock, 11, 0.1)
    cm = g.admit("m", org="A", prompt_tokens=50, max_tokens=100)
    ticket = await cm.__aenter__()
    await stream(ticket, clock, 11, 0.1)
    # 89 tokens of budget left at 0.1 s, of which the ended streams used 11 of 20: 4.9 s.
    assert g.estimated_wait_s("m", 0, "A") == pytest.approx(4.9, abs=0.01)
    await cm.__aexit__(None, None, None)

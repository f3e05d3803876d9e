"""The gateway's fair queue as the scheduler of a pool's slots, end to end through OverloadGuard:
two organizations flood a pool of few slots with unequal numbers of clients and answers of 16-160
tokens; each admitted stream holds its slot for as many ticks of a virtual clock as its answer has
tokens. The tokens each organization streams over the second half of the run are its share.
First come first served would give the organization with more clients more tokens (3:1 here); the
virtual token counters must give the weights' ratio instead. Also: a waiter whose renewed
estimate moved past its bound is refused then (not when the bound ran out), and a standing queue
(contended for the long bound on end, or arrivals outpacing the slots freed, which a burst's retries do
not) shortens the bound to the first-token target until refusals stop, and a waiter cancelled as its
slot is granted hands the slot on."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

from services.gateway.config import OverloadConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.overload import BURST_WINDOW_S, OverloadGuard, Overloaded
from tests.gateway.admission_helpers import VirtualClock, report

SLOTS = 4
TICKS = 1200


def guard(**cfg) -> OverloadGuard:
    return OverloadGuard(OverloadConfig(**{"follow_pool_load": False, "max_in_flight_per_model": SLOTS,
                                           "min_in_flight_per_model": 1, "max_queued_per_model": 256,
                                           "queue_timeout_s": 600.0, **cfg}), GatewayMetrics())


async def shares(weights: dict[str, float], clients: dict[str, int]) -> dict[str, int]:
    g = guard()
    rng = random.Random(7)
    lengths = [rng.randint(16, 160) for _ in range(64)]
    streamed = {org: 0 for org in weights}
    tick = 0
    clock = asyncio.Condition()

    async def client(org: str, i: int) -> None:
        nonlocal tick
        while tick < TICKS:
            answer = lengths[i % len(lengths)]
            async with g.admit("m", org=org, weight=weights[org], prompt_tokens=50, max_tokens=answer):
                for _ in range(answer):
                    async with clock:
                        seen = tick
                        await clock.wait_for(lambda: tick > seen or tick >= TICKS)
                    if tick >= TICKS:
                        return
                    if tick >= TICKS // 2:
                        streamed[org] += 1
            i += clients[org]

    tasks = [asyncio.create_task(client(org, i)) for org in weights for i in range(clients[org])]
    for _ in range(TICKS):
        for _ in range(20):            # let every admitted stream reach its next wait, and waiters in
            await asyncio.sleep(0)
        async with clock:
            tick += 1
            clock.notify_all()
    async with clock:
        clock.notify_all()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    return streamed


async def test_equal_weights_share_the_slots_equally_whatever_their_clients():
    s = await shares({"A": 1.0, "B": 1.0}, {"A": 24, "B": 8})
    assert s["A"] + s["B"] >= SLOTS * TICKS // 2 * 0.9, s     # the slots stayed busy
    assert s["A"] / s["B"] == pytest.approx(1.0, rel=0.1), s


async def test_weights_two_to_one_give_two_to_one_even_to_the_smaller_flood():
    s = await shares({"A": 2.0, "B": 1.0}, {"A": 8, "B": 24})
    assert s["A"] / s["B"] == pytest.approx(2.0, rel=0.1), s


async def test_a_waiter_whose_estimate_moves_past_its_bound_is_refused_then_with_retry_after():
    clock = VirtualClock()
    g = OverloadGuard(OverloadConfig(max_in_flight_per_model=64, max_queued_per_model=64, queue_timeout_s=60.0,
                                     stream_tokens_per_s=20.0, ttft_target_s=1.0,
                                     burst_share=0.0),   # every queue may be a burst's: the long bound
                      GatewayMetrics(), clock=clock)
    g.set_pool({"m": [report(1, base=0.010)]})          # 20 streams at 20 tokens/s
    async with g.admit("m", max_tokens=200):
        clock.t += 200                                   # streams of 200 tokens hold their slot 200 s
    async with contextlib.AsyncExitStack() as held:
        for i in range(g.limit("m")):                    # one admitted every 10 s: they free their
            clock.t += 10 if i else 0                    # slots 10, 20, ... 200 s from now
            await held.enter_async_context(g.admit("m", max_tokens=200))
        waiter = asyncio.create_task(g.admit("m").__aenter__())
        await asyncio.sleep(0.01)
        assert not waiter.done()                         # the next slot frees in 10 s, within 60 s
        g.set_pool({"m": [report(1, base=0.040, per_seq=0.005)]})   # the pool slows: this line gives 2
        assert g.limit("m") == 2                         # streams at 20 tokens/s (the last line 390 s old)
        with pytest.raises(Overloaded) as refused:       # 19 of the 20 must end first: 190 s, past the
            await asyncio.wait_for(waiter, 5)            # bound, so refused now, long before the 60 s ran out
    assert "estimated wait 190" in refused.value.message            # back in 190 - 60 / 2 = 160 s, capped at
    assert refused.value.headers["retry-after-ms"] == "60000"       # what the openai SDK honours (60 s)
    assert refused.value.headers["Retry-After"] == "60"


async def test_a_standing_queue_bounds_the_wait_by_the_first_token_target_and_ends_a_window_past_its_last_refusal():
    g = guard(queue_timeout_s=0.2, ttft_target_s=0.05, sustained_window_s=0.1)
    assert g.wait_bound_s("m") == 0.2
    async with contextlib_stack(g, SLOTS):
        waiter = asyncio.create_task(g.admit("m").__aenter__())      # every slot taken: it waits
        await asyncio.sleep(0.01)
        assert g.wait_bound_s("m") == 0.2                            # a burst so far
        with pytest.raises(Overloaded, match="queue timeout"):
            await waiter
        assert g.wait_bound_s("m") == 0.05                           # contended for 0.2 s on end
        assert g.wait_bound_s("m", "light") == 0.2                   # not for one with nothing in flight
    async with g.admit("m"):                                         # a free slot, but a refusal
        assert g.wait_bound_s("m") == 0.05                           # within the last window (0.1 s)
    await asyncio.sleep(0.15)
    async with g.admit("m"):
        assert g.wait_bound_s("m") == 0.2                            # nobody refused for a window: over


async def test_a_standing_queue_leaves_room_for_the_measured_first_token():
    clock = VirtualClock()
    g = sustained_guard(clock)                                       # first-token target 1 s
    async with g.admit("m") as ticket:
        clock.t += 0.4
        ticket.first_token()                                         # 0.4 s from admission
        clock.t += 7.6                                               # held 8 s: a slot frees every 2 s
    g._gate("m").standing = True                                     # as after a sustained overload
    g._gate("m").refused_at = clock.t
    async with g.admit("m"):
        assert g.wait_bound_s("m") == pytest.approx(0.6)             # 1 s less the 0.4 measured
        async with g.admit("m") as ticket:
            clock.t += 1.5
            ticket.first_token()                                     # the mean moves to 0.62 s
        assert g.wait_bound_s("m") == pytest.approx(1.0 - (0.4 + 0.2 * 1.1))
        for _ in range(12):                                          # short streams: 0.2 s holds
            async with g.admit("m"):
                clock.t += 0.2
        hold, first_token = g._gate("m").hold_s, g._gate("m").first_token_s
        assert hold < 1.0 and g.wait_bound_s("m") == pytest.approx(1.0 - first_token)   # slots free: not capped
        async with contextlib_stack(g, SLOTS - 1):                   # every slot taken
            assert g.wait_bound_s("m") == pytest.approx(hold / SLOTS)   # one slot's turn at most
    assert g.wait_bound_s("m", "idle") == 30.0                       # nothing in flight: the long bound


class Stream:
    """A request that holds its slot, once granted, until end()."""

    def __init__(self, g: OverloadGuard):
        self._done = asyncio.Event()
        self.task = asyncio.create_task(self._run(g))

    async def _run(self, g: OverloadGuard) -> None:
        async with g.admit("m"):
            await self._done.wait()

    async def end(self) -> None:
        self._done.set()
        await self.task


def sustained_guard(clock: VirtualClock, **cfg) -> OverloadGuard:
    return OverloadGuard(OverloadConfig(**{"follow_pool_load": False, "max_in_flight_per_model": SLOTS,
                                           "max_queued_per_model": 256, "queue_timeout_s": 30.0, "ttft_target_s": 1.0,
                                           "sustained_window_s": 10.0, **cfg}),
                         GatewayMetrics(), clock=clock)


async def test_arrivals_outpacing_the_slots_freed_make_a_queue_stand_before_the_long_bound_runs_out():
    clock = VirtualClock()
    g = sustained_guard(clock, burst_arrival_s=600.0)    # the standing rules alone
    streams = [Stream(g) for _ in range(SLOTS)]
    await asyncio.sleep(0)
    for second in range(15):                             # one newcomer a second, no slot freed
        streams.append(Stream(g))
        await asyncio.sleep(0)
        assert g.wait_bound_s("m") == 30.0, second       # contended < 1.5 windows: maybe a burst
        clock.t += 1
    assert g.wait_bound_s("m") == 1.0                    # 15 s on end, 9 in the last window, 0 freed
    for s in streams:
        s.task.cancel()
    await asyncio.gather(*(s.task for s in streams), return_exceptions=True)


async def test_a_queue_turning_standing_holds_the_waiters_it_took_to_the_short_bound():
    clock = VirtualClock()
    g = sustained_guard(clock, burst_arrival_s=600.0)    # the standing rules alone
    streams = [Stream(g) for _ in range(SLOTS)]
    await asyncio.sleep(0)
    waiters = []
    for _ in range(15):                                  # queued under the long bound (30 s), a second apart
        waiters.append(Stream(g))
        await asyncio.sleep(0)
        clock.t += 1
    assert not any(w.task.done() for w in waiters)
    newcomer = Stream(g)                                 # finds the queue standing (15 s, outpaced)
    for _ in range(5):                                   # the refused waiters' tasks end
        await asyncio.sleep(0)
    refused = [w for w in waiters if w.task.done()]
    assert refused == waiters[:14]                       # joined more than the short bound (1 s) ago
    for w in refused:
        error = w.task.exception()
        assert isinstance(error, Overloaded) and error.status == 429 and "Retry-After" in error.headers
    assert not waiters[14].task.done() and not newcomer.task.done()
    for s in streams + waiters[14:] + [newcomer]:
        s.task.cancel()
    await asyncio.gather(*(s.task for s in streams + waiters + [newcomer]), return_exceptions=True)


async def test_a_burst_whose_retries_come_as_slots_free_keeps_the_long_bound():
    clock = VirtualClock()
    g = sustained_guard(clock, max_queued_per_model=SLOTS // 2)
    burst = [Stream(g) for _ in range(2 * SLOTS)]        # all at once: a half admitted, a quarter queued,
    await asyncio.sleep(0)                               # a quarter refused (queue full), to come back
    refused = [s for s in burst if s.task.done()]
    assert len(refused) == SLOTS // 2 and all(isinstance(s.task.exception(), Overloaded) for s in refused)
    streams = [s for s in burst if not s.task.done()]
    clock.t += 16                                        # the burst has left the window, nothing since
    assert g.wait_bound_s("m") == 30.0
    for _ in range(12):                                  # then one arrival a second, as a slot frees
        await streams.pop(0).end()
        streams.append(Stream(g))
        await asyncio.sleep(0)
        clock.t += 1
        assert g.wait_bound_s("m") == 30.0
    for s in streams:
        s.task.cancel()
    await asyncio.gather(*(s.task for s in streams), return_exceptions=True)


async def test_newcomers_after_a_burst_that_refused_nobody_wait_the_short_bound_and_its_waiters_keep_theirs():
    clock = VirtualClock()
    g = sustained_guard(clock)                           # burst_arrival_s: 2 s
    streams = [Stream(g) for _ in range(SLOTS)]
    await asyncio.sleep(0)
    burst = []
    for _ in range(3):                                   # the burst's waiters, over 1.5 s
        burst.append(Stream(g))
        await asyncio.sleep(0)
        assert g.wait_bound_s("m") == 30.0
        clock.t += 0.5
    clock.t += 1.0                                       # 3 s after the queue formed
    assert g.wait_bound_s("m") == 1.0                    # new load: it would wait behind the burst
    newcomer = Stream(g)
    await asyncio.sleep(0)
    waiters = g._gates["m"].queue.ordered()
    assert [w.deadline - w.queued_at for w in waiters] == [30.0, 30.0, 30.0, 1.0]
    clock.t += 1.0
    with pytest.raises(Overloaded) as refused:          # no slot freed within its bound (1 s here too)
        await asyncio.wait_for(newcomer.task, 5)
    assert refused.value.status == 429 and "Retry-After" in refused.value.headers
    assert not any(w.task.done() for w in burst)         # the burst's waiters are not turned away
    assert g._gates["m"].standing                        # new load: the overload is sustained
    assert g.wait_bound_s("m") == 1.0                    # a short-bound refusal brings no burst retry
    assert g.wait_bound_s("m", org="light") == 30.0      # nothing in flight: not the overload
    for s in streams + burst:
        s.task.cancel()
    await asyncio.gather(*(s.task for s in streams + burst), return_exceptions=True)


async def test_a_queue_formed_as_the_pool_filled_over_time_stands_once_half_a_second_old_and_a_bursts_does_not():
    clock = VirtualClock()
    g = sustained_guard(clock)                           # burst_arrival_s: 2 s; a burst: 2 arrivals in it
    streams = []
    for _ in range(SLOTS):                               # the pool fills over 12 s, one arrival each 3 s
        streams.append(Stream(g))
        await asyncio.sleep(0)
        clock.t += 3
    assert g.wait_bound_s("m") == 30.0                   # no queue yet
    newcomer = Stream(g)                                 # finds the pool full: a burst may be starting
    await asyncio.sleep(0)
    [waiter] = g._gates["m"].queue.ordered()
    assert not g._gates["m"].standing and waiter.deadline - waiter.queued_at == 30.0
    clock.t += BURST_WINDOW_S
    second = Stream(g)                                   # none came: new load
    await asyncio.sleep(0)
    assert g._gates["m"].standing and g.wait_bound_s("m") == 1.0
    waiters = g._gates["m"].queue.ordered()
    assert [w.deadline - w.queued_at for w in waiters] == [1.0, 1.0]   # the short bound from its first waiter on
    for s in streams + [newcomer, second]:
        s.task.cancel()
    await asyncio.gather(*(s.task for s in streams + [newcomer, second]), return_exceptions=True)

    clock.t += 100                                       # the same pool filled by a burst
    g = sustained_guard(clock)
    burst = [Stream(g) for _ in range(SLOTS + 1)]
    await asyncio.sleep(0)
    [waiter] = g._gates["m"].queue.ordered()
    assert not g._gates["m"].standing and waiter.deadline - waiter.queued_at == 30.0
    for s in burst:
        s.task.cancel()
    await asyncio.gather(*(s.task for s in burst), return_exceptions=True)


@pytest.mark.parametrize("turns", range(5))
async def test_a_waiter_cancelled_as_its_slot_is_granted_hands_the_slot_on(turns):
    g = sustained_guard(VirtualClock())
    streams = [Stream(g) for _ in range(SLOTS + 1)]
    await asyncio.sleep(0)
    holder, waiter = streams[0], streams[-1]
    holder._done.set()                   # the slot frees as the client goes away, a few turns apart
    for _ in range(turns):
        await asyncio.sleep(0)
    waiter.task.cancel()
    with pytest.raises(asyncio.CancelledError):    # not a task that goes on, holding the slot
        await asyncio.wait_for(waiter.task, 5)
    await holder.task
    gate = g._gates["m"]
    assert gate.in_flight == SLOTS - 1 and not len(gate.queue)
    for s in streams[1:-1]:
        await s.end()
    assert gate.in_flight == 0


def contextlib_stack(g: OverloadGuard, n: int):
    import contextlib

    class Held(contextlib.AsyncExitStack):
        async def __aenter__(self):
            await super().__aenter__()
            for _ in range(n):
                await self.enter_async_context(g.admit("m"))
            return self
    return Held()


async def test_in_a_standing_queue_each_organization_keeps_one_waiter_and_the_owed_one_more():
    import contextlib
    g = guard(queue_timeout_s=0.2, ttft_target_s=0.05)
    async with contextlib.AsyncExitStack() as held:
        await held.enter_async_context(g.admit("m", org="light"))
        for _ in range(SLOTS - 1):
            await held.enter_async_context(g.admit("m", org="heavy"))
        with pytest.raises(Overloaded, match="queue timeout"):         # every slot taken for 0.2 s
            await held.enter_async_context(g.admit("m", org="heavy"))
        assert g.wait_bound_s("m", "light") == 0.2                    # owed the next slot: may wait for it
        assert g.wait_bound_s("m", "heavy") == 0.2                    # nobody of heavy queued: one may wait
        waiter = asyncio.create_task(held.enter_async_context(g.admit("m", org="heavy")))
        await asyncio.sleep(0.01)
        assert g.wait_bound_s("m", "heavy") == 0.05                   # served more, one queued: refused at once
        assert g.wait_bound_s("m", "light") == 0.2
        assert g.wait_bound_s("m", "") == 0.2                         # nothing in flight
        with pytest.raises(Overloaded, match="queue timeout"):
            await waiter

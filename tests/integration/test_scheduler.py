"""The slot queue as the router sees it: how many requests wait for a slot."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial

from prometheus_client import CollectorRegistry

from proxy.backends.scheduler import Decide, Scheduler
from proxy.config.settings import QueueSettings
from proxy.core.routing.wakes import Awaiting
from proxy.core.server.fleet import (
    BackendPhase,
    Fleet,
    NoPlacement,
    Placement,
    Probe,
    SlotPhase,
    SlotProbe,
)
from proxy.core.server.placement import Need, place
from proxy.metrics import ProxyMetrics
from tests.waiting import until


async def test_waiting_counts_the_requests_queued_for_a_slot() -> None:
    fleet = Fleet(["b0"])
    fleet.apply_probe(0, Probe(BackendPhase.READY, (SlotProbe(0, False, 0, -1),)), now=0.0)
    scheduler = Scheduler(fleet, QueueSettings(), ProxyMetrics(CollectorRegistry()), time.monotonic)

    def decide() -> Placement | NoPlacement:
        return place(fleet.backends, Need())

    first = await scheduler.acquire(decide)
    assert scheduler.waiting() == 0
    queued = [asyncio.create_task(scheduler.acquire(decide)) for _ in range(3)]
    await until(lambda: scheduler.waiting() == 3, "three requests wait")
    scheduler.release(first, clean=True)  # the first waiter gets the slot
    await until(lambda: scheduler.waiting() == 2, "two requests wait")
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    assert scheduler.waiting() == 0


async def test_a_release_re_decides_waiters_only_while_a_slot_is_free() -> None:
    fleet = Fleet(["b0"])
    fleet.apply_probe(0, Probe(BackendPhase.READY, (SlotProbe(0, False, 0, -1),)), now=0.0)
    scheduler = Scheduler(fleet, QueueSettings(), ProxyMetrics(CollectorRegistry()), time.monotonic)
    decided: list[int] = []

    def decider(n: int) -> Callable[[], Placement | NoPlacement]:
        def decide() -> Placement | NoPlacement:
            decided.append(n)
            return place(fleet.backends, Need())

        return decide

    first = await scheduler.acquire(decider(0))
    queued = [asyncio.create_task(scheduler.acquire(decider(n))) for n in (1, 2, 3)]
    await until(lambda: scheduler.waiting() == 3, "three requests wait")
    decided.clear()
    scheduler.release(first, clean=True)
    # The first waiter takes the freed slot; the fleet is full again, so the others are not
    # asked (they would only answer "busy").
    assert decided == [1]
    assert scheduler.waiting() == 2
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)


async def test_a_release_asks_waiters_only_until_the_freed_slot_is_taken() -> None:
    """Slot 2 stays idle, wanted by no one; slot 1 frees. The first waiter passes it up, the
    second takes it; the third is not asked: the fleet is as it was when it chose to wait."""
    fleet = Fleet(["b0"])
    probe = Probe(BackendPhase.READY, tuple(SlotProbe(i, False, 0, -1) for i in range(3)))
    fleet.apply_probe(0, probe, now=0.0)
    scheduler = Scheduler(fleet, QueueSettings(), ProxyMetrics(CollectorRegistry()), time.monotonic)
    first = await scheduler.acquire(lambda: Placement(0, (0,), 0))
    second = await scheduler.acquire(lambda: Placement(0, (1,), 1))
    decided: list[str] = []

    def decider(name: str, takes: bool) -> Callable[[], Placement | NoPlacement]:
        def decide() -> Placement | NoPlacement:
            decided.append(name)
            free = fleet.backends[0].slots[1].phase is SlotPhase.IDLE
            return Placement(0, (1,), 1) if takes and free else NoPlacement.BUSY

        return decide

    queued = [
        asyncio.create_task(scheduler.acquire(decider(name, takes)))
        for name, takes in (("a", False), ("b", True), ("c", True))
    ]
    await until(lambda: scheduler.waiting() == 3, "three requests wait")
    decided.clear()
    scheduler.release(second, clean=True)
    assert decided == ["a", "b"]
    assert (await queued[1]) == Placement(0, (1,), 1)
    assert scheduler.waiting() == 2
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    scheduler.release(first, clean=True)


def _clocked(slots: int) -> tuple[Scheduler, list[float]]:
    """One backend of ``slots`` idle slots, and its scheduler on a clock the test sets
    (``now[0]``, from 10 s)."""
    fleet = Fleet(["b0"])
    probe = Probe(BackendPhase.READY, tuple(SlotProbe(i, False, 0, -1) for i in range(slots)))
    fleet.apply_probe(0, probe, now=0.0)
    now = [10.0]
    scheduler = Scheduler(fleet, QueueSettings(), ProxyMetrics(CollectorRegistry()), lambda: now[0])
    return scheduler, now


async def test_a_hold_whose_timer_fires_before_its_end_is_woken_again_at_its_end() -> None:
    """A waiter waits behind slot 0, held until ``end``. The timer fires before the end (the
    injected clock lags; uvloop may fire a millisecond early): the hold still stands, so
    nobody is asked, and a new timer runs: the waiter takes the slot at the end."""
    scheduler, now = _clocked(1)
    end = 10.002

    def decide() -> Placement | Awaiting:
        if now[0] < end:
            return Awaiting(None, end, (0, 0))
        return Placement(0, (0,), 0)

    waiter = asyncio.create_task(scheduler.acquire(decide))
    await until(lambda: scheduler.waiting() == 1, "the request holds")
    await asyncio.sleep(0.01)  # the first timer has fired, the clock short of the end
    now[0] = end
    placed = await asyncio.wait_for(waiter, 5)
    assert placed == Placement(0, (0,), 0)


async def test_a_release_asks_in_arrival_order_only_the_waiters_it_can_affect() -> None:
    """32 busy slots (one idle slot in 32 is still saturation: no bar moves). ``a`` waits
    for slot 5, then ``c`` for any slot, then ``b`` for slot 7. Slot 7 frees: ``c`` is asked
    and passes it up, ``b`` takes it. Slot 9 frees: only ``c`` is asked, and passes it up;
    ``a`` never is."""
    fleet = Fleet(["b0"])
    probe = Probe(BackendPhase.READY, tuple(SlotProbe(i, False, 0, -1) for i in range(32)))
    fleet.apply_probe(0, probe, now=0.0)
    scheduler = Scheduler(fleet, QueueSettings(), ProxyMetrics(CollectorRegistry()), time.monotonic)
    running = [await scheduler.acquire(partial(Placement, 0, (i,), i)) for i in range(32)]
    decided: list[str] = []

    def decider(name: str, slot: int | None) -> Decide:
        def decide() -> Placement | NoPlacement | Awaiting:
            decided.append(name)
            if slot is None:
                return NoPlacement.BUSY
            if fleet.backends[0].slots[slot].phase is SlotPhase.IDLE:
                return Placement(0, (slot,), slot)
            return Awaiting(frozenset({("slot", 0, slot)}))

        return decide

    queued = [
        asyncio.create_task(scheduler.acquire(decider(name, slot)))
        for name, slot in (("a", 5), ("c", None), ("b", 7))
    ]
    await until(lambda: scheduler.waiting() == 3, "three requests wait")
    decided.clear()
    scheduler.release(running[7], clean=True)
    assert decided == ["c", "b"]
    assert (await queued[2]) == Placement(0, (7,), 7)
    decided.clear()
    scheduler.release(running[9], clean=True)
    assert decided == ["c"]
    assert scheduler.waiting() == 2
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)


async def test_a_release_of_a_slot_the_backend_no_longer_has_asks_no_one_and_raises_not() -> None:
    """The backend came back with one slot of two while slot 1 was in flight: its release
    frees nothing there, and a waiter is not asked about it."""
    fleet = Fleet(["b0"])
    two = Probe(BackendPhase.READY, tuple(SlotProbe(i, False, 0, -1) for i in range(2)))
    fleet.apply_probe(0, two, now=0.0)
    scheduler = Scheduler(fleet, QueueSettings(), ProxyMetrics(CollectorRegistry()), time.monotonic)
    first = await scheduler.acquire(partial(Placement, 0, (0,), 0))
    second = await scheduler.acquire(partial(Placement, 0, (1,), 1))
    decided: list[int] = []

    def decide() -> Placement | NoPlacement:
        decided.append(1)
        return NoPlacement.BUSY

    waiter = asyncio.create_task(scheduler.acquire(decide))
    await until(lambda: scheduler.waiting() == 1, "a request waits")
    one = Probe(BackendPhase.READY, (SlotProbe(0, True, 0, -1),))
    fleet.apply_probe(0, one, now=1.0)
    decided.clear()
    scheduler.release(second, clean=True)
    assert decided == []
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    scheduler.release(first, clean=True)


async def test_a_holds_end_asks_the_waiters_behind_it_and_those_its_slot_can_affect() -> None:
    """Slot 0 is held for its session until ``end``; the 31 others are busy. ``k`` waits for
    busy slot 5, then ``h`` behind the hold. At the end slot 0 is as if released: ``h`` is
    asked and takes it; ``k``, first to arrive but filed under none of that release's keys,
    is not asked."""
    scheduler, now = _clocked(32)
    running = [await scheduler.acquire(partial(Placement, 0, (i,), i)) for i in range(1, 32)]
    end, decided = 10.002, []

    def behind() -> Placement | Awaiting:
        decided.append("h")
        return Awaiting(None, end, (0, 0)) if now[0] < end else Placement(0, (0,), 0)

    def keyed() -> Awaiting:
        decided.append("k")
        return Awaiting(frozenset({("slot", 0, 5)}))

    k = asyncio.create_task(scheduler.acquire(keyed))
    await until(lambda: scheduler.waiting() == 1, "k waits")
    h = asyncio.create_task(scheduler.acquire(behind))
    await until(lambda: scheduler.waiting() == 2, "both wait")
    decided.clear()
    now[0] = end
    assert (await asyncio.wait_for(h, 5)) == Placement(0, (0,), 0)
    assert decided == ["h"]
    k.cancel()
    await asyncio.gather(k, return_exceptions=True)
    for placement in running:
        scheduler.release(placement, clean=True)


async def test_a_waiter_behind_a_hold_taken_back_first_decides_again_at_its_end() -> None:
    """``h`` waits behind slot 0, held until ``end``. Its session takes the slot back before
    then, so at the end no freed slot is idle and no release is asked: ``h`` still decides
    again (it would else wait on, with no timer), and takes slot 1, idle all along."""
    scheduler, now = _clocked(2)
    end = 10.002

    def behind() -> Placement | Awaiting:
        return Awaiting(None, end, (0, 0)) if now[0] < end else Placement(0, (1,), 1)

    h = asyncio.create_task(scheduler.acquire(behind))
    await until(lambda: scheduler.waiting() == 1, "h waits")
    back = await scheduler.acquire(partial(Placement, 0, (0,), 0))  # the session is back
    now[0] = end
    assert (await asyncio.wait_for(h, 5)) == Placement(0, (1,), 1)
    scheduler.release(back, clean=True)


async def test_a_keyed_waiter_beside_a_held_slot_decides_again_when_the_hold_ends() -> None:
    """``k`` waits for busy slot 5 (filed under its key) while idle slot 0 is held until
    ``end``: its decision names that end, and at the end it decides again and takes slot 0,
    though nothing it is filed under was released."""
    scheduler, now = _clocked(32)
    running = [await scheduler.acquire(partial(Placement, 0, (i,), i)) for i in range(1, 32)]
    end = 10.002

    def keyed() -> Placement | Awaiting:
        if now[0] < end:
            return Awaiting(frozenset({("slot", 0, 5)}), end, (0, 0))
        return Placement(0, (0,), 0)

    k = asyncio.create_task(scheduler.acquire(keyed))
    await until(lambda: scheduler.waiting() == 1, "k waits")
    now[0] = end
    assert (await asyncio.wait_for(k, 5)) == Placement(0, (0,), 0)
    for placement in running:
        scheduler.release(placement, clean=True)


async def test_the_waiters_behind_a_hold_decide_again_at_its_end_in_arrival_order() -> None:
    """``w1`` waits for busy slot 1, then ``w2`` behind the holds of slots 0 and 2 (ending
    together; slot 0's named). Slot 1 frees, given back unsent: ``w1`` is asked and now
    waits behind the holds too, filed after ``w2``. Slot 0's session takes it back; at the
    end no freed slot is idle, and both decide again in arrival order: ``w1`` first, so it
    gets the lower of slots 1 and 2."""
    scheduler, now = _clocked(3)
    slots = scheduler.fleet.backends[0].slots
    end, order, asked = 10.002, [], []

    def behind(name: str, keyed: bool) -> Decide:
        def decide() -> Placement | Awaiting:
            asked.append(name)
            if keyed and asked.count(name) == 1:
                return Awaiting(frozenset({("slot", 0, 1)}))
            if now[0] < end:
                return Awaiting(None, end, (0, 0))
            order.append(name)
            slot = next(s.id for s in slots if s.phase is SlotPhase.IDLE)
            return Placement(0, (slot,), slot)

        return decide

    blocker = await scheduler.acquire(partial(Placement, 0, (1,), 1))
    w1 = asyncio.create_task(scheduler.acquire(behind("w1", keyed=True)))
    await until(lambda: scheduler.waiting() == 1, "w1 waits")
    w2 = asyncio.create_task(scheduler.acquire(behind("w2", keyed=False)))
    await until(lambda: scheduler.waiting() == 2, "both wait")
    scheduler.release(blocker, clean=True, sent=False)  # w1 now waits behind the hold too
    assert asked.count("w1") == 2
    back = await scheduler.acquire(partial(Placement, 0, (0,), 0))  # the session is back
    now[0] = end
    placed = await asyncio.wait_for(asyncio.gather(w1, w2), 5)
    assert order == ["w1", "w2"]
    assert list(placed) == [Placement(0, (1,), 1), Placement(0, (2,), 2)]
    scheduler.release(back, clean=True)


async def test_a_backend_marked_down_lets_its_waiters_go_elsewhere() -> None:
    """``w`` waits for busy slot 0 of backend 1; a request there fails to connect and
    backend 1 is marked down: ``w`` decides again at once and takes backend 0's slot."""
    fleet = Fleet(["b0", "b1"])
    for index in (0, 1):
        fleet.apply_probe(index, Probe(BackendPhase.READY, (SlotProbe(0, False, 0, -1),)), 0.0)
    scheduler = Scheduler(fleet, QueueSettings(), ProxyMetrics(CollectorRegistry()), time.monotonic)
    running = await scheduler.acquire(partial(Placement, 1, (0,), 0))

    def decide() -> Placement | Awaiting:
        if fleet.backends[1].phase is BackendPhase.READY:
            return Awaiting(frozenset({("slot", 1, 0)}))
        return Placement(0, (0,), 0)

    w = asyncio.create_task(scheduler.acquire(decide))
    await until(lambda: scheduler.waiting() == 1, "w waits")
    scheduler.mark_down(1)
    assert (await asyncio.wait_for(w, 5)) == Placement(0, (0,), 0)
    scheduler.release(running, clean=True, sent=False)


async def test_a_waiter_for_a_freed_slot_another_took_decides_again() -> None:
    """32 busy slots. ``t`` (any release) and then ``v`` (waiting for slot 0, its
    conversation) wait. Slot 0 frees and ``t``, first to arrive, takes it: slot 0 will hold
    ``t``'s prompt, so ``v`` decides again at once (and waits for slot 7 now), and takes
    slot 7 when it frees."""
    fleet = Fleet(["b0"])
    probe = Probe(BackendPhase.READY, tuple(SlotProbe(i, False, 0, -1) for i in range(32)))
    fleet.apply_probe(0, probe, now=0.0)
    scheduler = Scheduler(fleet, QueueSettings(), ProxyMetrics(CollectorRegistry()), time.monotonic)
    running = [await scheduler.acquire(partial(Placement, 0, (i,), i)) for i in range(32)]
    slots, decided = fleet.backends[0].slots, []

    def t_decide() -> Placement | NoPlacement:
        idle = [s.id for s in slots if s.phase is SlotPhase.IDLE]
        return Placement(0, (idle[0],), idle[0]) if idle else NoPlacement.BUSY

    def v_decide() -> Placement | Awaiting:
        decided.append(slots[0].phase)
        wanted = 0 if not decided[1:] else 7  # (slot 0 lost its conversation to t)
        if slots[wanted].phase is SlotPhase.IDLE:
            return Placement(0, (wanted,), wanted)
        return Awaiting(frozenset({("slot", 0, wanted)}))

    t = asyncio.create_task(scheduler.acquire(t_decide))
    await until(lambda: scheduler.waiting() == 1, "t waits")
    v = asyncio.create_task(scheduler.acquire(v_decide))
    await until(lambda: scheduler.waiting() == 2, "both wait")
    scheduler.release(running[0], clean=True)
    assert (await t) == Placement(0, (0,), 0)
    assert decided == [SlotPhase.BUSY, SlotPhase.BUSY]  # v decided again after t took slot 0
    scheduler.release(running[7], clean=True)
    assert (await asyncio.wait_for(v, 5)) == Placement(0, (7,), 7)


async def test_deciding_again_behind_the_same_hold_files_its_end_once() -> None:
    """Fifty waiters behind slot 0's hold decide again at each of a hundred releases of
    slot 1, still behind the same hold: each end is filed once per waiter."""
    scheduler, _ = _clocked(2)
    waiters = [
        asyncio.create_task(scheduler.acquire(lambda: Awaiting(None, 15.0, (0, 0))))
        for _ in range(50)
    ]
    await until(lambda: scheduler.waiting() == 50, "fifty wait")
    for _ in range(100):
        placement = await scheduler.acquire(partial(Placement, 0, (1,), 1))
        scheduler.release(placement, clean=True)
    assert len(scheduler._hold_ends) == 50
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


async def test_a_waiter_whose_decision_fails_fails_alone() -> None:
    """A release asks ``broken``, whose decision raises, then ``w``: the error goes to
    ``broken``'s request, not to the release's, and ``w`` still takes the freed slot."""
    scheduler, _ = _clocked(1)
    running = await scheduler.acquire(partial(Placement, 0, (0,), 0))
    calls: list[str] = []

    def broken() -> NoPlacement:
        calls.append("broken")
        if len(calls) > 1:
            raise RuntimeError("a routing bug")
        return NoPlacement.BUSY

    failing = asyncio.create_task(scheduler.acquire(broken))
    await until(lambda: scheduler.waiting() == 1, "broken waits")
    w = asyncio.create_task(scheduler.acquire(lambda: place(scheduler.fleet.backends, Need())))
    await until(lambda: scheduler.waiting() == 2, "both wait")
    scheduler.release(running, clean=True)  # (raises not)
    assert (await w) == Placement(0, (0,), 0)
    (error,) = await asyncio.gather(failing, return_exceptions=True)
    assert isinstance(error, RuntimeError)
    assert scheduler.waiting() == 0

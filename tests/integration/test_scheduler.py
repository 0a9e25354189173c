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

"""Slot admission: place a request now, or wait in a bounded queue for a slot.

The decision of *where* is ``core.fleet.place``; this module adds the waiting. A request that
cannot be placed joins a FIFO queue (at most ``queue.max_waiting``) and waits at most
``queue.max_wait_seconds``; every release or probe calls ``wake``, which places waiting
requests in order (a request that does not fit yet does not block one that does). A full
queue or an expired wait answers 503 with ``Retry-After``; when no backend is up at all the
answer is immediate. A waiter cancelled (client gone) at the moment it was granted a slot
gives the slot straight back, so no claim leaks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from proxy.config import QueueSettings
from proxy.core.fleet import Fleet, Need, NoPlacement, Placement, place
from proxy.errors import ServiceUnavailable
from proxy.metrics import ProxyMetrics

_Waiter = tuple[Need, "asyncio.Future[Placement]"]


class Scheduler:
    def __init__(
        self,
        fleet: Fleet,
        settings: QueueSettings,
        metrics: ProxyMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.fleet = fleet
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        self._waiters: list[_Waiter] = []

    def _unavailable(self, message: str, reason: str) -> ServiceUnavailable:
        self._metrics.rejected.labels(reason).inc()
        retry = str(self._settings.retry_after_seconds)
        return ServiceUnavailable(message, code=reason, headers={"Retry-After": retry})

    def _try(self, need: Need) -> Placement | NoPlacement:
        result = place(self.fleet.backends, need)
        if isinstance(result, Placement):
            self.fleet.claim(result, self._clock())
        return result

    async def acquire(self, need: Need) -> Placement:
        # Waiters that fit a free slot were granted it when it freed, so a slot free now
        # fits none of them: taking it skips no one who could use it.
        result = self._try(need)
        if isinstance(result, Placement):
            return result
        if result is NoPlacement.DOWN:
            raise self._unavailable("no backend is available", "no_backend")
        if len(self._waiters) >= self._settings.max_waiting:
            raise self._unavailable("all slots are busy and the queue is full", "queue_full")
        return await self._wait(need)

    async def _wait(self, need: Need) -> Placement:
        future: asyncio.Future[Placement] = asyncio.get_running_loop().create_future()
        self._waiters.append((need, future))
        self._metrics.queued.inc()
        try:
            await asyncio.wait([future], timeout=self._settings.max_wait_seconds)
        except asyncio.CancelledError:
            self._give_back(future)
            raise
        finally:
            self._metrics.queued.dec()
            self._waiters = [w for w in self._waiters if w[1] is not future]
        if future.done():
            return future.result()
        future.cancel()
        raise self._unavailable("timed out waiting for a free slot", "wait_timeout")

    def _give_back(self, future: asyncio.Future[Placement]) -> None:
        if future.done() and not future.cancelled() and future.exception() is None:
            self.release(future.result(), clean=True)
        future.cancel()

    def release(self, placement: Placement, *, clean: bool) -> None:
        self.fleet.release(placement, self._clock(), clean=clean)
        self.wake()

    def wake(self) -> None:
        """Place waiting requests in FIFO order wherever they now fit."""
        for need, future in list(self._waiters):
            if future.done():
                continue
            result = self._try(need)
            if isinstance(result, Placement):
                future.set_result(result)
            elif result is NoPlacement.DOWN:
                future.set_exception(self._unavailable("no backend is available", "no_backend"))

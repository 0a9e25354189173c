"""Slot admission: place a request now, or wait in a bounded queue until it can be placed.

*Where* is decided by a closure the caller passes (``decide``: current fleet -> a placement
or a ``NoPlacement``), built on ``core.server.fleet.place`` or ``core.routing.decision.route``; this
module adds the waiting. A request that cannot be placed joins a FIFO queue (at most
``queue.max_waiting``) and waits at most ``queue.max_wait_seconds``.

Waiting is event-driven: a decision changes only when a slot frees, a probe changes what a
backend can take, or the waiter's own clock runs out (``recheck_at``: the time its routing
stops waiting for a busy slot; ``Awaiting.until``: the end of the first hold among the idle
slots it could not take, when it decides again, and the held slot is to the others as if
released). A release asks only the waiters it can affect, first come first served, and only
until the freed slots are taken again: from then on every other waiter sees the fleet as it
was when it chose to wait, so deciding again would only say so; but a later waiter that
waited for a freed slot itself decides again, since that slot will now hold another
request's prompt. Which waiters a release can affect is an index, updated whenever a waiter
decides: a routed waiter is filed under the keys its decision gives
(``core.routing.wakes.Awaiting``: the slot it waits for, its conversation, its head when a
kin slot could serve it nearly as much, the lower bar of a saturated or pressed fleet), any
other under "any release". A release asks, in arrival order, the waiters filed under one of
its keys (``core.routing.wakes.release_keys``) or under any release. A waiter it does not
ask would decide to wait again, so the first waiter to take a freed slot is the one asking
every waiter in arrival order would find. A release costs the decisions of the waiters it
can affect that pass the freed slot up (none, when the first one takes it), not the number
waiting.

A full queue or an expired wait answers 503 with ``Retry-After``, unless the request chose
to wait beside a slot it could take (for a busy slot that saves more): then ``settle``, its
decision with no waiting by choice, places it there. At shutdown every waiter is answered 503
(``close``): none of them reached a backend. While no backend is ready
(start-up, a restart's model load) requests wait the same way, and go as soon as a probe finds
a backend ready (``wake``); so do requests that use no slot (``backend``). A backend that
fails a request is down until a probe finds it ready, and every waiter decides again
(``mark_down``). Once every backend has been down (none loading, none not yet probed) for
``down_seconds``, waiting and arriving requests are answered 503: none is restarting. A
waiter cancelled (client gone) at the moment it was granted a slot gives the slot straight
back, so no claim leaks; a waiter whose decision raises fails alone.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

from proxy.config.settings import QueueSettings
from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.routing.wakes import Awaiting, Key, release_keys
from proxy.core.server.fleet import BackendPhase, Fleet, NoPlacement, Placement, SlotPhase
from proxy.errors import ServiceUnavailable
from proxy.metrics import ProxyMetrics

Decide = Callable[[], Placement | NoPlacement | Awaiting]
# s: uvloop counts whole milliseconds, so a timer may fire up to one early: a hold's timer is
# set this much later, so as not to fire before the hold has ended
LATER = 0.001
SlotRef = tuple[int, int]  # (backend index, slot id)
Future = asyncio.Future[Placement]


@dataclass
class _Waiter:
    decide: Decide
    content: Fingerprint | None  # the prompt it brings
    order: int  # its arrival: waiters are asked first come, first served
    keys: frozenset[Key] | None = None  # of its last decision (None: any release)
    until: float | None = None  # of its last decision: the first hold it waited beside ends
    held: SlotRef | None = None  # ... that hold's slot


class Scheduler:
    def __init__(
        self,
        fleet: Fleet,
        settings: QueueSettings,
        metrics: ProxyMetrics,
        clock: Callable[[], float],
        down_seconds: float = math.inf,
    ) -> None:
        """``down_seconds``: how long requests wait while every backend is down."""
        self.fleet = fleet
        self._down_seconds = down_seconds
        self._down_since: float | None = None  # since when every backend is down
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        self._waiters: dict[Future, _Waiter] = {}  # in arrival order (a dict keeps it)
        # which waiters a release can affect (module docstring), each in arrival order
        self._filed: dict[Key, dict[Future, None]] = {}
        self._any: dict[Future, None] = {}  # any release may change their decision
        self._anchors: Counter[int] = Counter()  # of the conversation keys filed
        self._arrivals = 0
        self._ready: list[asyncio.Future[None]] = []  # requests that use no slot, waiting
        self._wake_due = 0.0  # when the pending timer of the earliest hold end fires
        # (hold end, filing, held slot, waiter): a heap; stale once the waiter decided again
        self._hold_ends: list[tuple[float, int, SlotRef, Future]] = []
        self._filings = itertools.count()  # (the order breaks ties: waiters never compared)
        self._closing = False  # shutting down: no request waits any more

    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiters)

    def _unavailable(self, message: str, reason: str) -> ServiceUnavailable:
        self._metrics.rejected.labels(reason).inc()
        retry = str(self._settings.retry_after_seconds)
        return ServiceUnavailable(message, code=reason, headers={"Retry-After": retry})

    def _try(
        self, decide: Decide, content: Fingerprint | None
    ) -> Placement | NoPlacement | Awaiting:
        result = decide()
        if isinstance(result, Placement):
            self.fleet.claim(result, self._clock(), content)
        elif result is NoPlacement.DOWN and self._long_down():
            raise self._down()
        return result

    def _down(self) -> ServiceUnavailable:
        return self._unavailable("no backend is up", "no_backend")

    def _long_down(self) -> bool:
        """Every backend has been down (none loading or not yet probed) for ``down_seconds``:
        none is restarting (llama-server listens, answering 503, while it loads a model), so
        a request is answered 503 now rather than kept for a backend that may not come back."""
        since = self._down_since
        return since is not None and self._clock() >= since + self._down_seconds

    def _due(self, due: float) -> float:
        """``due``, or sooner: when the fleet, all down, has been so for ``down_seconds``."""
        since = self._down_since
        return due if since is None else min(due, since + self._down_seconds)

    def _note_phases(self) -> None:
        """Keep when the fleet went all down (None while a backend is up or coming up)."""
        down = all(b.phase is BackendPhase.DOWN for b in self.fleet.backends)
        if not down:
            self._down_since = None
        elif self._down_since is None:
            self._down_since = self._clock()

    async def acquire(
        self,
        decide: Decide,
        content: Fingerprint | None = None,
        recheck_at: float | None = None,
        settle: Decide | None = None,
    ) -> Placement:
        """A placement now or after waiting; ``recheck_at``: when ``decide`` changes its mind
        by itself (its bound on waiting for a busy slot passes), if it ever does; ``settle``:
        the decision without waiting by choice, asked when the request may not wait (the
        queue is full, or its bound passed) before it is refused."""
        # Waiters that fit a free slot were granted it when it freed, so a slot free now
        # fits none of them: taking it skips no one who could use it.
        if self._closing or not self._has_room():  # it may not wait: decided so at once
            result = self._try(settle or decide, content)
            if isinstance(result, Placement):
                return result
            self._room()
        result = self._try(decide, content)
        if isinstance(result, Placement):
            return result
        waiter = _Waiter(decide, content, self._arrivals)
        self._arrivals += 1
        return await self._wait(waiter, result, recheck_at, settle)

    def _has_room(self) -> bool:
        return len(self._waiters) + len(self._ready) < self._settings.max_waiting

    def _room(self) -> None:
        if self._closing:
            raise self._unavailable("the proxy is shutting down", "shutting_down")
        if not self._has_room():
            raise self._unavailable("all slots are busy and the queue is full", "queue_full")

    def close(self) -> None:
        """Shutting down: every waiting request is answered 503 now (none reached a backend),
        and none waits from now on."""
        self._closing = True
        waiting: list[asyncio.Future[Any]] = [*self._waiters, *self._ready]
        for future in waiting:
            if not future.done():
                error = self._unavailable("the proxy is shutting down", "shutting_down")
                future.set_exception(error)
        for future in list(self._waiters):
            self._forget(future)  # (no release grants it a slot now)

    def _expired(self) -> ServiceUnavailable:
        if not self._any_ready():
            return self._unavailable("no backend became ready in time", "no_backend")
        return self._unavailable("timed out waiting for a free slot", "wait_timeout")

    def _any_ready(self) -> bool:
        return any(b.phase is BackendPhase.READY for b in self.fleet.backends)

    async def backend(self, pick: Callable[[], int | NoPlacement]) -> int:
        """A backend for a request that uses no slot (``pick``): now, or as soon as one is
        ready (``wake``), within the queue's bounds."""
        deadline = self._clock() + self._settings.max_wait_seconds
        while isinstance(index := pick(), NoPlacement):
            if index is NoPlacement.DOWN and self._long_down():
                raise self._down()
            if self._clock() >= deadline:
                raise self._expired()
            self._room()
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._ready.append(future)
            self._metrics.queued.inc()
            try:
                await asyncio.wait([future], timeout=self._due(deadline) - self._clock())
            finally:
                self._metrics.queued.dec()
                self._ready.remove(future)
            error = future.exception() if future.done() else None
            if error is not None:
                raise error  # (shutting down: ``close``)
        return index

    async def _wait(
        self,
        waiter: _Waiter,
        first: NoPlacement | Awaiting,
        recheck_at: float | None,
        settle: Decide | None,
    ) -> Placement:
        future: Future = asyncio.get_running_loop().create_future()
        self._waiters[future] = waiter
        self._file(future, waiter, first)
        self._metrics.queued.inc()
        deadline = self._clock() + self._settings.max_wait_seconds
        try:
            while not future.done() and self._clock() < deadline:
                due = self._due(deadline if recheck_at is None else min(recheck_at, deadline))
                await asyncio.wait([future], timeout=max(0.0, due - self._clock()))
                if not future.done() and self._long_down():
                    break
                if not future.done() and recheck_at is not None and self._clock() >= recheck_at:
                    recheck_at = None  # its own bound passed: decided again once
                    self._grant(future, waiter)
        except asyncio.CancelledError:
            self._give_back(future)
            raise
        finally:
            self._metrics.queued.dec()
            self._forget(future)
        if future.done():
            return future.result()
        future.cancel()
        if self._long_down():
            raise self._down()
        if settle is not None and isinstance(now := self._try(settle, waiter.content), Placement):
            return now  # (its bound passed beside a slot it chose not to take)
        raise self._expired()

    def _file(self, future: Future, waiter: _Waiter, result: NoPlacement | Awaiting) -> None:
        """Index a waiter by the keys of its last decision (``result``), and by the end of
        the hold it waits behind."""
        self._unfile(future, waiter)
        until, held = (result.until, result.held) if isinstance(result, Awaiting) else (None, None)
        if until is not None and held is not None and (until, held) != (waiter.until, waiter.held):
            self._hold_end(until, held, future)  # (the same end again: filed already)
        waiter.until, waiter.held = (until, held) if held is not None else (None, None)
        keys = waiter.keys = result.keys if isinstance(result, Awaiting) else None
        if keys is None:
            self._any[future] = None
            return
        for key in keys:
            self._filed.setdefault(key, {})[future] = None
            if key[0] == "conversation":
                self._anchors[key[1]] += 1

    def _unfile(self, future: Future, waiter: _Waiter) -> None:
        if waiter.keys is None:
            self._any.pop(future, None)
            return
        for key in waiter.keys:
            group = self._filed.get(key)
            if group is not None:
                group.pop(future, None)
                if not group:
                    del self._filed[key]
            if key[0] == "conversation":
                self._anchors[key[1]] -= 1
                if not self._anchors[key[1]]:
                    del self._anchors[key[1]]

    def _forget(self, future: Future) -> None:
        waiter = self._waiters.pop(future, None)
        if waiter is not None:
            self._unfile(future, waiter)

    def _give_back(self, future: asyncio.Future[Placement]) -> None:
        if future.done() and not future.cancelled() and future.exception() is None:
            self.release(future.result(), clean=True, sent=False)
        future.cancel()

    def release(
        self,
        placement: Placement,
        *,
        clean: bool,
        sent: bool = True,
        content: Fingerprint | None = None,
        n_tokens: int | None = None,
        remote: int | None = None,
    ) -> None:
        """End a claim (``core.server.fleet.Fleet.release``; ``remote``: a slot of it whose
        lease another replica holds), and ask the waiters the release can affect."""
        self.fleet.release(
            placement,
            self._clock(),
            clean=clean,
            sent=sent,
            content=content,
            n_tokens=n_tokens,
            remote=remote,
        )
        self.wake([(placement.backend, slot) for slot in placement.slots])

    def mark_down(self, index: int, phase: BackendPhase = BackendPhase.DOWN) -> None:
        """Backend ``index`` failed a request: down (or ``phase``) until a probe finds it
        ready, and every waiter decides again (one that waited for it may go elsewhere now)."""
        self.fleet.mark_down(index, phase)
        self.wake()

    def _grant(self, future: Future, waiter: _Waiter) -> None:
        try:
            result = self._try(waiter.decide, waiter.content)
        except Exception as exc:  # (its own request fails, not the one whose release asked)
            future.set_exception(exc)
            self._forget(future)
            return
        if isinstance(result, Placement):
            future.set_result(result)
            self._forget(future)  # granted: no longer waiting
        else:
            self._file(future, waiter, result)

    def wake(self, freed: Collection[SlotRef] | None = None) -> None:
        """Place waiting requests in FIFO order wherever they now fit: after a release of
        the ``freed`` slots, the waiters it can affect (module docstring), only until none
        of those slots is idle any more; otherwise (a probe, a hold's end) every waiter,
        until every slot of the ready backends is taken. Past that point the rest wait as
        they are: deciding again would only say so; but a waiter that waited for one of the
        freed slots decides again (``_retarget``)."""
        self._note_phases()
        if self._ready and self._any_ready():
            for ready in self._ready:
                if not ready.done():
                    ready.set_result(None)
        if not self._waiters:
            return
        if freed is not None:  # (a backend that came back with fewer slots has none of some)
            backends = self.fleet.backends
            freed = [(b, s) for b, s in freed if s < len(backends[b].slots)]
        asked: set[Future] = set()
        for future in list(self._waiters if freed is None else self._affected(freed)):
            if not self._open(freed):
                break
            asked.add(future)
            waiter = self._waiters.get(future)
            if waiter is not None and not future.done():
                self._grant(future, waiter)
        else:
            return
        if freed is not None:
            self._retarget(freed, asked)

    def _retarget(self, freed: Collection[SlotRef], asked: Collection[Future]) -> None:
        """The freed slots were taken again before every waiter filed under one of them was
        asked: a later waiter that waited for one of those slots waited for what it would
        hold, and it will now hold another request's prompt. Each such waiter decides again,
        in arrival order (the taker changed the slot it chose to wait for)."""
        for future in self._waiters_of(freed):
            if future in asked or future.done():
                continue
            waiter = self._waiters.get(future)
            if waiter is not None:
                self._grant(future, waiter)

    def _waiters_of(self, slots: Collection[SlotRef]) -> list[Future]:
        """The waiters filed as waiting for one of ``slots`` (not for any slot of its
        backend), in arrival order."""
        found: dict[Future, None] = {}
        for b, s in slots:
            found.update(self._filed.get(("slot", b, s), {}))
        return sorted((f for f in found if f in self._waiters), key=self._order)

    def _affected(self, freed: Collection[SlotRef]) -> Iterator[Future]:
        """The waiters a release of the ``freed`` slots can affect (module docstring), in
        arrival order."""
        backends = self.fleet.backends
        idle, slots = 0, 0
        for backend in backends:
            if backend.phase is BackendPhase.READY:
                idle += len(backend.idle_slots())
                slots += len(backend.slots)
        fleet, affected = (idle, slots, len(self._waiters)), dict(self._any)
        for b, s in freed:
            content = backends[b].slots[s].content
            for key in release_keys(b, s, content, self._anchors, fleet):
                affected.update(self._filed.get(key, {}))
        waiters = self._waiters
        yield from sorted((f for f in affected if f in waiters), key=lambda f: waiters[f].order)

    def _hold_end(self, when: float, slot: SlotRef, future: Future) -> None:
        """File a hold's end, and run one timer, for the earliest hold end pending."""
        heapq.heappush(self._hold_ends, (when, next(self._filings), slot, future))
        self._arm(when)

    def _arm(self, when: float) -> None:
        now = self._clock()
        if not now < self._wake_due <= when:
            self._wake_due = when
            delay = max(0.0, when - now) + LATER
            asyncio.get_running_loop().call_later(delay, self._timer)

    def _timer(self) -> None:
        """The holds that ended: their slots are as if released (``wake``), and each waiter
        behind one decides again, asked or not (its slot may have been taken back first)."""
        self._wake_due, now = 0.0, self._clock()
        ended: dict[SlotRef, None] = {}
        due: dict[Future, None] = {}
        while self._hold_ends and self._hold_ends[0][0] <= now:
            when, _, slot, future = heapq.heappop(self._hold_ends)
            waiter = self._waiters.get(future)
            if waiter is not None and waiter.until == when:  # (else it decided again since)
                ended[slot], due[future] = None, None
        if self._hold_ends:  # the next hold end
            self._arm(self._hold_ends[0][0])
        if ended:
            self.wake(list(ended))
        for future in sorted(due, key=self._order):  # (first come, first served)
            waiter = self._waiters.get(future)
            if waiter is not None and waiter.until is not None and waiter.until <= now:
                self._grant(future, waiter)

    def _order(self, future: Future) -> int:
        waiter = self._waiters.get(future)
        return waiter.order if waiter is not None else -1

    def _open(self, freed: Collection[SlotRef] | None) -> bool:
        """Whether a waiter could be placed now: a freed slot is still idle (None: any)."""
        if freed is None:
            return not self.fleet.full()
        backends = self.fleet.backends
        return any(backends[b].slots[s].phase is SlotPhase.IDLE for b, s in freed)

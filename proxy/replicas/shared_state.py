"""Coordination between proxy replicas through the state store.

With Redis configured, a replica:
- takes a *lease* on a slot after choosing it and before sending (atomic, so two replicas never
  pin one slot at once); a lost race marks the slot REMOTE and the request is routed again;
  leases are renewed (extended only, never re-created) every 0.5 s while held and released when
  the request ends, *before* the slot is free locally, so a later request of the same replica
  cannot take the slot under a lease that is being deleted; an aborted request's lease is left
  to expire (the slot may still be busy upstream); a replica that dies leaves leases that expire
  after ``lease_ttl_seconds``;
- *refreshes* its view before routing each request (one round trip for leases and slot records,
  shared by the requests that arrive while it is in flight), and in the background so queued
  requests see slots freed elsewhere: slots leased by others become REMOTE, and slot records
  written by others (what their requests left in the KV) replace older local content;
- *clears* the records of a backend it saw restart;
- registers each *release* (the hashes its session's next prompt will contain) and claims the
  release an arriving prompt continues, so how soon sessions come back is measured across
  replicas (``core.routing.returns``; ``shared_releases``).

Redis unavailable: every operation degrades to local state, the outage is counted and logged
once, and when Redis answers again the local slot table is written back (resync). A client
request never fails because of Redis. Leases are then only local claims: replicas pin only their
part of a split of the slots, and peers that still reach the store fence the part of one whose
heartbeat lapsed (``core.replicas.partition``, which explains the rules). As the store goes away
every slot this replica is not running on drains like an aborted one (pinnable once ``/slots`` shows
it idle): a slot another replica held could not otherwise be freed before Redis came back, and
one leased since the last view read looked idle. Coming back, a replica leases the slots it
pinned that still run and for ``HEARTBEAT_TTL`` keeps to its part of the outage's split (peers
reconnect within a maintenance round and lease theirs; a restarted Redis lists no heartbeats
yet). A replica that shuts down leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.replicas.homes import replica_id
from proxy.core.replicas.partition import FENCE_MARGIN, HEARTBEAT_TTL, Peers
from proxy.core.server.fleet import Fleet, Placement, SlotPhase
from proxy.metrics import ProxyMetrics
from proxy.replicas.releases import SharedReleases
from proxy.replicas.roster import Roster
from proxy.state import SlotRecord, SlotRef, StateStore, StateStoreUnavailable
from proxy.state.base import LEFT

log = logging.getLogger(__name__)
T = TypeVar("T")
# s: the shortest wait for a claim's start. uvloop counts whole milliseconds, so its timers fire
# up to one early: a claim woken just before its start waits on (refused, a slot of this
# replica's own part would stay REMOTE until the store came back)
CLAIM_POLL = 0.001
MAINTAIN_SECONDS = 0.5  # between maintenance rounds: renewals, the view, the heartbeat
__all__ = ["FENCE_MARGIN", "HEARTBEAT_TTL", "SharedState"]


class SharedState:
    def __init__(
        self,
        store: StateStore,
        fleet: Fleet,
        metrics: ProxyMetrics,
        wall: Callable[[], float],
        *,
        enabled: bool,
        lease_ttl: float = 30.0,
        record_ttl: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        url: str | None = None,
        secret: bytes | None = None,
        # backends whose slots could not be seen while the store was down: drain them
        on_down: Callable[[list[int], float], None] = lambda backends, after: None,
    ) -> None:
        self.store = store
        self.enabled = enabled
        self.token = uuid.uuid4().hex[:12]  # this replica, in logs and X-Cache-Replica
        self.owner = replica_id(self.token, url)  # with the URL peers forward to, if any
        self._fleet = fleet
        self._metrics = metrics
        self.wall = wall
        self._clock = clock  # the fleet's (last use of a slot)
        self._lease_ttl = lease_ttl
        self._record_ttl = record_ttl
        self._held: set[SlotRef] = set()
        self._local: set[SlotRef] = set()  # pinned while the store was down: no lease yet
        self.peers = Peers(self.owner, lease_ttl)  # live and vanished replicas (``clock``)
        self.roster = Roster(self.owner, secret, metrics, wall)  # what it believes of the list
        self.releases = SharedReleases(self)
        self._refreshing: asyncio.Future[None] | None = None  # the view read in flight
        self.stopped = False  # set at shutdown: maintain() ends after its current round
        self.up = True
        # called with the backends whose slots now drain (the store just went down: another
        # replica's leases can no longer be seen); the app polls them after ``after`` s
        self.on_down = on_down
        metrics.store_up.set(1)

    def _ref(self, backend: int, slot: int) -> SlotRef:
        return (self._fleet.backends[backend].label, slot)

    async def call(self, op: str, call: Awaitable[T], default: T) -> T:
        """Await a store operation; on an outage count it, log once, return ``default``. While
        the store is down it is not asked (``default`` at once: a stalled Redis would make
        each call wait out its socket timeout); ``maintain`` pings it until it is back."""
        if not self.up:
            if inspect.iscoroutine(call):
                call.close()
            return default
        try:
            result = await call
        except StateStoreUnavailable as exc:
            self._metrics.store_errors.labels(op).inc()
            if self.up:
                log.warning("state store unavailable (%s): routing on local state", exc)
                self.up = False
                self._metrics.store_up.set(0)
                self.peers.went_down(self._held, self._clock())
                remote = self._fleet.recast(SlotPhase.REMOTE, SlotPhase.DRAINING)
                idle = self._fleet.recast(SlotPhase.IDLE, SlotPhase.DRAINING)
                after = max(0.0, self.peers.claim_from() - self._clock())
                self.on_down(sorted(set(remote + idle)), after)
            return default
        return result

    async def take(self, placement: Placement) -> int | None:
        """Lease the placement's slots (the pinned one, or every slot of a request that
        needs the whole backend), all or none. None: leased; else the slot another replica
        holds, or (store down) that is another replica's part of the fleet: the caller marks
        it REMOTE."""
        if not self.enabled:
            return None
        taken: list[int] = []
        for slot in _slots_of(placement):
            if not await self._take(placement.backend, slot):
                for done in taken:  # (all or none)
                    await self._give_back(placement.backend, done)
                return slot
            taken.append(slot)
        return None

    async def _take(self, backend: int, slot: int) -> bool:
        if self.peers.keep_off(backend, slot, self._counts(), self._clock()):
            return False  # a part another replica may pin without a lease
        if not self.up:
            return await self._claim(backend, slot)
        ref = self._ref(backend, slot)
        taken = self.store.acquire_lease(ref, self.owner, self._lease_ttl, self.wall())
        result = await self.call("acquire_lease", taken, None)
        if result is None:  # the store went away just now
            return await self._claim(backend, slot)
        if result:
            self._held.add(ref)
            log.debug("lease taken %s by %s", ref, self.owner)
            return True
        log.debug("lease refused %s for %s", ref, self.owner)
        return False

    async def _claim(self, backend: int, slot: int) -> bool:
        """The store is down: pin only slots whose leases still stand in it and this
        replica's part, and remember the pin (no lease records it) to lease it when the
        store is back. Peers that still reach the store lease any other slot until they see
        this replica's heartbeat lapse and fence its part, so that waits for it."""
        ref, counts = self._ref(backend, slot), self._counts()
        claim = self.peers.may_claim(ref, backend, counts, self._clock())
        while claim is None:  # not yet (a timer may fire up to a millisecond early)
            await asyncio.sleep(max(self.peers.claim_from() - self._clock(), CLAIM_POLL))
            if self.up:  # back meanwhile: lease it as usual
                return await self._take(backend, slot)
            claim = self.peers.may_claim(ref, backend, counts, self._clock())
        if claim:
            self._local.add(ref)
        return bool(claim)

    def _fenced(self, backend: int, slot: int) -> bool:
        return self.peers.fenced(backend, slot, self._counts(), self._clock())

    def _counts(self) -> list[int]:
        return [len(b.slots) for b in self._fleet.backends]

    async def give_back(self, placement: Placement) -> None:
        if self.enabled:
            for slot in _slots_of(placement):
                await self._give_back(placement.backend, slot)

    async def _give_back(self, backend: int, slot: int) -> None:
        ref = self._ref(backend, slot)
        self._local.discard(ref)
        if ref in self._held:  # (held until released: it stands if the store is gone)
            log.debug("lease given back %s by %s", ref, self.owner)
            await self.call("release_lease", self.store.release_lease(ref, self.owner), None)
            self._held.discard(ref)

    def abandon(self, placement: Placement) -> None:
        """Stop renewing the leases of slots an aborted request may still be using upstream:
        other replicas get them when the leases expire (this replica drains them meanwhile)."""
        if self.enabled:
            for slot in _slots_of(placement):
                ref = self._ref(placement.backend, slot)
                self._held.discard(ref)
                self._local.discard(ref)

    async def get_affinity(self, key: str) -> SlotRef | None:
        return await self.call("get_affinity", self.store.get_affinity(key, self.wall()), None)

    async def set_affinity(self, key: str, ref: SlotRef, ttl: float) -> None:
        await self.call("set_affinity", self.store.set_affinity(key, ref, ttl, self.wall()), None)

    async def publish(self, backend: int, slot: int, fp: Fingerprint, n_tokens: int) -> None:
        if not self.enabled:
            return
        record = SlotRecord(
            fp.hashes, fp.tokens, fp.anchor, n_tokens, 0.0, fp.sealed, fp.users, fp.parts
        )
        put = self.store.put_slot(self._ref(backend, slot), record, self._record_ttl, self.wall())
        stamp = await self.call("put_slot", put, None)  # the store's: a view then leaves it out
        slots = self._fleet.backends[backend].slots  # (it may have come back with fewer)
        if stamp is not None and slot < len(slots) and stamp > slots[slot].record_at:
            slots[slot].record_at = stamp

    async def refresh(self) -> None:
        """Read the shared view (one round trip) and fold it into the fleet. Requests that arrive
        while a read is in flight share it rather than each sending its own: the view cannot be
        older than their arrival by more than that round trip, and leases, not the view, keep
        two replicas off one slot."""
        if not self.enabled or not self.up:
            return
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._refresh())
            self._refreshing.add_done_callback(self._refreshed)
        await asyncio.shield(self._refreshing)

    def _refreshed(self, task: asyncio.Future[None]) -> None:
        if self._refreshing is task:
            self._refreshing = None

    async def _refresh(self) -> None:
        slots = [(b.label, s) for b in self._fleet.backends for s in b.slots]
        refs = [(label, s.id) for label, s in slots]
        known = {(label, s.id): s.record_at for label, s in slots}  # 0.0: none yet
        view = await self.call("view", self.store.view(refs, self.wall(), known), None)
        if view is None:  # the store is down: its leases and records are unknown, not gone
            return
        now, wall = self._clock(), self.wall() if view.now is None else view.now
        for backend in self._fleet.backends:
            leased = {
                s
                for (label, s), o in view.owners.items()
                if label == backend.label and o != self.owner
            }
            mine = {
                s: (Fingerprint(*r.content()), r.n_tokens, r.updated_at)
                for (label, s), r in view.records.items()
                if label == backend.label
            }
            if self.peers.fences:  # (rare: a peer's heartbeat lapsed)
                leased |= {s.id for s in backend.slots if self._fenced(backend.index, s.id)}
            # (a lease is first seen up to a maintenance round after it was taken: a lease
            # that ends sooner than its TTL after that, less two rounds, was given back)
            lapse = self._lease_ttl - 2 * MAINTAIN_SECONDS
            self._fleet.fold_shared(backend.index, leased, mine, now, wall, lapse)

    async def forget_backend(self, index: int) -> None:
        backend = self._fleet.backends[index]
        refs = [(backend.label, s.id) for s in backend.slots]
        await self.call("clear_slots", self.store.clear_slots(refs), None)

    async def maintain(
        self, on_change: Callable[[], None], every: float = MAINTAIN_SECONDS
    ) -> None:
        """Background: renew held leases, refresh the view, detect recovery and resync; a
        round that raises is logged (again when its error changes) and the next one runs.
        Ends on ``stopped`` too: redis-py 8.1 can swallow a cancel (a SIGTERM hung in CI)."""
        failed = ""  # the last round's error
        while not self.stopped:
            await asyncio.sleep(every)
            try:
                if not self.up:
                    await self._recover()
                    continue
                for ref in list(self._held):
                    await self._renew(ref)
                await self.refresh()
                on_change()
                await self.heartbeat()  # after: two round trips first cost 2-replica hit rate
                failed = ""
            except Exception as exc:
                if repr(exc) != failed:
                    log.exception("shared-state maintenance round failed: retrying")
                failed = repr(exc)

    async def _renew(self, ref: SlotRef) -> None:
        """Renew a held lease. One that is gone (the store lost it: flushed, failed over,
        evicted) is taken again while it is free, so peers do not see its slot idle while
        its request runs; one another replica took meanwhile is a conflict."""
        renew = self.store.renew_lease(ref, self.owner, self._lease_ttl, self.wall())
        if await self.call("renew_lease", renew, True) or ref not in self._held:
            return
        again = self.store.acquire_lease(ref, self.owner, self._lease_ttl, self.wall())
        if await self.call("acquire_lease", again, True) is False:
            log.warning("lease %s was lost and another replica holds it now", ref)
            self._metrics.store_conflicts.inc()

    async def heartbeat(self) -> None:
        entry, expires = self.roster.entry(HEARTBEAT_TTL)
        wall, last = self.wall(), self.roster.written
        found = await self.call(
            "heartbeat", self.store.heartbeat(entry, HEARTBEAT_TTL, wall, expires, last), None
        )
        if found is None:
            return
        live, left, read_at = self.roster.read(found, entry, HEARTBEAT_TTL)
        hold = self.peers.hold
        for fence in self.peers.beat(live, left, self._clock(), read_at, found.now):
            log.warning(
                "replica %s lapsed: its part kept off until back, %.0f s at most",
                fence.replica,
                hold,
            )
        self._metrics.replicas_fenced.set(len(self.peers.reported))
        self._metrics.replicas_live.set(len(live) - len(self.peers.unknown_to))

    async def leave(self) -> None:
        """At shutdown: stop counting as live, so peers do not fence this replica's part."""
        if self.enabled and self.up:
            mark, expires = self.roster.entry(HEARTBEAT_TTL, LEFT)
            entry = self.roster.written or self.owner
            gone = self.store.leave(entry, HEARTBEAT_TTL, self.wall(), mark, expires)
            await self.call("leave", gone, None)

    async def _recover(self) -> None:
        with contextlib.suppress(StateStoreUnavailable):
            await self.store.ping()
            self.up = True
            self._metrics.store_up.set(1)
            log.warning("state store back: resyncing the local slot table")
            self.peers.rejoined, self.peers.stale = self._clock(), {}
            self.peers.joined = None  # (a restarted store lists this replica anew)
            await self._lease_local()
            for backend in self._fleet.backends:
                for slot in backend.slots:
                    if slot.content is not None and slot.phase is SlotPhase.IDLE:
                        await self.publish(backend.index, slot.id, slot.content, slot.n_tokens)

    async def _lease_local(self) -> None:
        """Lease the slots pinned while the store was down whose requests still run."""
        for ref in sorted(self._local):
            taken = self.store.acquire_lease(ref, self.owner, self._lease_ttl, self.wall())
            result = await self.call("acquire_lease", taken, None)
            if result is None:
                return  # down again: the rest stay local claims
            if ref not in self._local:  # the request ended meanwhile (and no other took it)
                if ref not in self._held:
                    release = self.store.release_lease(ref, self.owner)
                    await self.call("release_lease", release, None)
            elif result:
                self._held.add(ref)
            else:
                self._metrics.store_conflicts.inc()
                log.warning("slot %s was pinned by another replica during the outage", ref)
            self._local.discard(ref)


def _slots_of(placement: Placement) -> tuple[int, ...]:
    """The slots a placement runs on: its pinned one, or every slot of a request that needs
    the whole backend (``n`` > 1, a batch, an embedding): the server picks among them."""
    return placement.slots if placement.pin is None else (placement.pin,)

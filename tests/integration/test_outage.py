"""Two replicas' shared state (``proxy.replicas.shared_state``) through a store that goes down and
comes back, one replica reconnecting before the other; clocks are injected."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.core.replicas.partition import STALE_MARGIN
from proxy.core.server.fleet import BackendPhase, Fleet, Placement, Probe, SlotProbe
from proxy.metrics import ProxyMetrics
from proxy.replicas.shared_state import FENCE_MARGIN, HEARTBEAT_TTL, SharedState
from proxy.state import InMemoryStateStore, StateStoreUnavailable


class Breakable(InMemoryStateStore):
    """The in-memory store, every call failing while ``down``; ``restart`` empties it."""

    down = False

    def restart(self) -> None:
        InMemoryStateStore.__init__(self)
        self.down = False

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name.startswith("_") or name in ("down", "restart") or not callable(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                raise StateStoreUnavailable("down")
            return await attr(*args, **kwargs)

        return call


class Link:
    """One replica's way to a store shared with others, cut on its own (``down``): a
    partial outage."""

    def __init__(self, store: InMemoryStateStore) -> None:
        self.store, self.down = store, False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                raise StateStoreUnavailable("cut")
            return await attr(*args, **kwargs)

        return call


def replica(
    store: Any,
    now: list[float],
    registry: CollectorRegistry | None = None,
    url: str | None = None,
) -> SharedState:
    fleet = Fleet(["b0"])
    idle = tuple(SlotProbe(i, False, 0, 1) for i in range(2))
    fleet.apply_probe(0, Probe(BackendPhase.READY, idle), now=0.0)
    metrics = ProxyMetrics(registry or CollectorRegistry())
    clock = lambda: now[0]  # noqa: E731
    return SharedState(store, fleet, metrics, clock, enabled=True, clock=clock, url=url)


async def took(state: Any, slot: int) -> bool:
    """Whether ``state`` (a replica's shared state) leased slot ``slot`` of backend 0."""
    return await state.take(Placement(0, (slot,), slot)) is None


async def test_a_replica_back_first_keeps_off_the_slot_another_pinned_in_the_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A and B split one backend's two slots while the store is down. A reconnects first:
    the store holds no lease on B's slot, and A's fresh heartbeat list holds only A, so
    leases and a new split would both have let A pin the slot B is running on. A keeps to
    the outage's split for a heartbeat period; by then B is back and leases it. B, back a
    maintenance round after A, is not reported as lapsed (it was: a log line and the
    ReplicaLapsed alert after every Redis restart)."""
    store, now = Breakable(), [100.0]
    registry = CollectorRegistry()
    a, b = replica(store, now, registry), replica(store, now)
    for r in (a, b, a):
        await r.heartbeat()  # each has read the other
    store.down = True
    await a.refresh()
    await b.refresh()  # both notice
    now[0] += HEARTBEAT_TTL + FENCE_MARGIN  # claims start once peers must see a lapse
    mine = {r: [await took(r, s) for s in range(2)] for r in (a, b)}
    assert sorted([mine[a], mine[b]]) == [[False, True], [True, False]]  # a split
    theirs = mine[a].index(False)  # B runs a request there, with no lease in the store

    store.restart()
    await a._recover()
    await a.heartbeat()  # the store lists only A until B's next heartbeat
    assert not await took(a, theirs)
    await b._recover()  # B leases the slot its request still runs on
    now[0] += HEARTBEAT_TTL
    await b.heartbeat()  # live again: A lifts the fence it put on B's part
    await a.heartbeat()
    assert not a.peers.fences
    assert not await took(a, theirs)
    assert registry.get_sample_value("llama_cache_proxy_replicas_fenced") == 0
    assert "lapsed" not in caplog.text
    await b.give_back(Placement(0, (theirs,), theirs))
    assert await took(a, theirs)


async def test_a_slot_pinned_by_two_replicas_in_an_outage_is_counted_when_it_returns() -> None:
    """B joined just before the outage: A had read B's heartbeat, B had not read A's, so B
    kept every slot while A kept its part - both pinned one slot. The store cannot undo that,
    but the replica whose lease is refused on reconnect counts it for the operator."""
    store, now, registry = Breakable(), [100.0], CollectorRegistry()
    a, b = replica(store, now, registry), replica(store, now)
    for r in (b, a):
        await r.heartbeat()  # B's list: B alone; A's: both
    store.down = True
    await a.refresh()
    await b.refresh()
    now[0] += HEARTBEAT_TTL + FENCE_MARGIN
    (both,) = [s for s in range(2) if await took(a, s)]  # A's part
    assert await took(b, both)  # B's part is every slot
    store.restart()
    await b._recover()
    await a._recover()
    conflicts = registry.get_sample_value("llama_cache_proxy_state_store_conflicts_total")
    assert conflicts == 1


async def partial_outage(now: list[float]) -> tuple[SharedState, SharedState, list[float]]:
    """Replicas A and B that read each other's heartbeats; then A alone loses the store and
    B reads A's heartbeat lapsed. Returns A, B, and the delays A's /slots polls got."""
    drained: list[float] = []
    link = Link(InMemoryStateStore())
    a, b = replica(link, now), replica(Link(link.store), now)
    a.on_down = lambda backends, after: drained.append(after)
    for r in (a, b, a):
        await r.heartbeat()
    link.down = True
    await a.refresh()  # A notices
    now[0] += HEARTBEAT_TTL
    await b.heartbeat()  # A's heartbeat has lapsed
    return a, b, drained


def fenced_gauge(r: SharedState) -> float:
    return r._metrics.replicas_fenced._value.get()  # type: ignore[no-any-return]


def cut(r: SharedState, down: bool) -> None:
    link = r.store
    assert isinstance(link, Link)
    link.down = down


async def test_a_replica_that_alone_loses_the_store_keeps_its_part_and_others_keep_off_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A partial outage: A loses the store, B still reaches it. A's pins then hold no lease,
    and B, leasing through the store, took A's part as soon as A's heartbeat lapsed: a slot
    pinned twice. Now B keeps off the part of a replica that vanished without leaving, and A
    claims its part only once B must have read the lapse (and polls /slots only then, so it
    sees what B started before)."""
    now = [100.0]
    a, b, drained = await partial_outage(now)
    assert drained == [HEARTBEAT_TTL + FENCE_MARGIN]
    assert b.peers.fences
    assert fenced_gauge(b) == 0
    now[0] += FENCE_MARGIN
    (ours,) = [s for s in range(2) if await took(a, s)]
    assert not await took(b, ours)  # fenced: A may be running there
    assert await took(b, 1 - ours)
    now[0] += HEARTBEAT_TTL
    await b.heartbeat()
    assert fenced_gauge(b) == 1
    assert f"replica {a.owner} lapsed" in caplog.text

    cut(a, False)
    await a._recover()  # A leases what it pinned, then is live again
    await a.heartbeat()
    await b.heartbeat()
    assert not b.peers.fences
    assert fenced_gauge(b) == 0
    assert not await took(b, ours)  # now A's lease keeps B off
    await a.give_back(Placement(0, (ours,), ours))
    assert await took(b, ours)


async def test_a_fence_ends_after_the_lease_ttl_and_holds_through_the_fencers_own_outage() -> None:
    """A replica that vanished may have died: its part is kept off only as long as a lease
    of a dead replica would be. Until then a fencing replica that loses the store too keeps
    off it (its own split, read after the lapse, no longer lists the vanished replica)."""
    now = [100.0]
    a, b, _ = await partial_outage(now)
    (ours,) = [s for s in range(2) if a.peers.owns(0, s, [2])]
    cut(b, True)
    await b.refresh()
    now[0] += FENCE_MARGIN
    assert not await took(b, ours)
    cut(b, False)
    await b._recover()
    now[0] += 30.0  # lease_ttl_seconds
    await b.heartbeat()
    assert await took(b, ours)


async def test_a_replica_that_shut_down_is_not_fenced() -> None:
    now = [100.0]
    link = Link(InMemoryStateStore())
    a, b = replica(link, now), replica(Link(link.store), now)
    for r in (a, b, a):
        await r.heartbeat()
    await a.leave()
    await b.heartbeat()
    assert not b.peers.fences
    assert all([await took(b, s) for s in range(2)])


async def test_a_replica_restarted_at_its_address_lifts_the_fence_on_its_predecessor() -> None:
    """A crashed replica's part is kept off, but once a new replica advertises its URL it
    is known dead: its peers pin the whole fleet again without waiting the lease TTL."""
    now, store = [100.0], InMemoryStateStore()
    a, b = (replica(store, now, url=f"http://10.0.0.{i}:8000") for i in (1, 2))
    for r in (a, b, a):
        await r.heartbeat()
    (theirs,) = [s for s in range(2) if b.peers.owns(0, s, [2])]
    now[0] += HEARTBEAT_TTL + 0.1  # b crashed: no heartbeat, no leave
    await a.heartbeat()
    assert not await took(a, theirs)
    restarted = replica(store, now, url="http://10.0.0.2:8000")
    await restarted.heartbeat()
    await a.heartbeat()
    assert not a.peers.fences
    assert await took(a, theirs)


async def test_a_lease_held_as_the_store_went_down_keeps_its_slot_until_it_expires() -> None:
    """The store goes away while A runs requests under leases on both slots. A lease stands
    in the store, so peers keep off that slot until it expires: A runs its next request on
    the slot of its part at once (other claims of its part wait until its peers must have
    fenced it). The slot of another's part it leaves, lease or not: in a full outage that
    replica cannot see the lease and pins its part (both pinned it before)."""
    store, now = Breakable(), [100.0]
    a, b = replica(store, now), replica(store, now)
    for r in (a, b, a):
        await r.heartbeat()
    mine = next(s for s in range(2) if a.peers.owns(0, s, [2]))
    theirs = 1 - mine
    assert await took(a, mine)
    assert await took(a, theirs)
    store.down = True
    for slot in (mine, theirs):
        await a.give_back(Placement(0, (slot,), slot))  # the release fails: an outage
    assert await took(a, mine)  # no wait: its lease stands
    await a.give_back(Placement(0, (mine,), mine))
    now[0] += 2.0  # past the claims' start (its peers have fenced its part)
    assert not await took(a, theirs)
    now[0] += 30.0 - STALE_MARGIN  # lease_ttl_seconds: the lease has expired
    assert await took(a, mine)  # its part
    assert not await took(a, theirs)


async def test_a_claim_woken_before_its_start_waits_on_and_takes_its_part() -> None:
    """uvloop's timers count whole milliseconds, so the wait for the start of claims can
    end just before it. The claim is then not yet decided, not refused: a refusal marks the
    slot REMOTE, and a replica that refused its own part this way served nothing until the
    store came back."""
    store, now = Breakable(), [100.0]
    a, b = replica(store, now), replica(store, now)
    for r in (a, b, a):
        await r.heartbeat()
    store.down = True
    await a.refresh()  # noticed
    ours = next(s for s in range(2) if a.peers.owns(0, s, [2]))
    now[0] = a.peers.claim_from() - 0.002  # every wait ends with the clock still short of it

    async def start() -> None:
        await asyncio.sleep(0.05)
        now[0] = a.peers.claim_from()

    catch_up = asyncio.create_task(start())
    assert await took(a, ours)
    await catch_up


async def test_a_replica_its_peer_has_not_read_yet_pins_nothing_in_an_outage() -> None:
    """A reads the list before B's first heartbeat: A knows no peer and keeps every slot
    when the store goes down, and B, which knows A, would have pinned its half too: the same
    slot pinned twice. B sees that A's last read came before its own first entry, and pins
    nothing until a later read shows A's next heartbeat; then the two split the slots."""
    store, now = Breakable(), [100.0]
    a, b = replica(store, now), replica(store, now)
    await a.heartbeat()  # the list: A alone
    now[0] += 0.1
    await b.heartbeat()  # A and B; A has not read B
    assert a.peers.live == [a.owner]
    assert sorted(b.peers.live) == sorted([a.owner, b.owner])
    store.down = True
    for r in (a, b):
        await r.refresh()  # noticed
    now[0] += HEARTBEAT_TTL + FENCE_MARGIN
    assert [await took(a, s) for s in range(2)] == [True, True]
    assert [await took(b, s) for s in range(2)] == [False, False]
    for s in range(2):
        await a.give_back(Placement(0, (s,), s))  # A's requests end

    store.down = False
    for r in (a, b):
        await r._recover()
    for r in (a, b, a, b):  # each reads the other's heartbeat written after its own first
        now[0] += 0.5
        await r.heartbeat()
    assert not a.peers.unknown_to
    assert not b.peers.unknown_to
    store.down = True
    for r in (a, b):
        await r.refresh()
    now[0] += HEARTBEAT_TTL + FENCE_MARGIN
    mine = [[await took(r, s) for s in range(2)] for r in (a, b)]
    assert sorted(mine) == [[False, True], [True, False]]  # a split

"""Two replicas' shared state (``proxy.shared_state``) through a store that goes down and
comes back, one replica reconnecting before the other; clocks are injected."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from proxy.core.fleet import BackendPhase, Fleet, Placement, Probe, SlotProbe
from proxy.metrics import ProxyMetrics
from proxy.shared_state import HEARTBEAT_TTL, SharedState
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


def replica(
    store: Breakable, now: list[float], registry: CollectorRegistry | None = None
) -> SharedState:
    fleet = Fleet(["b0"])
    idle = tuple(SlotProbe(i, False, 0, 1) for i in range(2))
    fleet.apply_probe(0, Probe(BackendPhase.READY, idle), now=0.0)
    metrics = ProxyMetrics(registry or CollectorRegistry())
    clock = lambda: now[0]  # noqa: E731
    return SharedState(store, fleet, metrics, clock, enabled=True, clock=clock)


async def test_a_replica_back_first_keeps_off_the_slot_another_pinned_in_the_outage() -> None:
    """A and B split one backend's two slots while the store is down. A reconnects first:
    the store holds no lease on B's slot, and A's fresh heartbeat list holds only A, so
    leases and a new split would both have let A pin the slot B is running on. A keeps to
    the outage's split for a heartbeat period; by then B is back and leases it."""
    store, now = Breakable(), [100.0]
    a, b = replica(store, now), replica(store, now)
    for r in (a, b, a):
        await r._heartbeat()  # each has read the other
    store.down = True
    await a.refresh()
    await b.refresh()  # both notice
    mine = {r: [await r.take(Placement(0, (s,), s)) for s in range(2)] for r in (a, b)}
    assert sorted([mine[a], mine[b]]) == [[False, True], [True, False]]  # a split
    theirs = mine[a].index(False)  # B runs a request there, with no lease in the store

    store.restart()
    await a._recover()
    await a._heartbeat()  # the store lists only A until B's next heartbeat
    assert not await a.take(Placement(0, (theirs,), theirs))
    await b._recover()  # B leases the slot its request still runs on
    now[0] += HEARTBEAT_TTL
    await a._heartbeat()
    assert not await a.take(Placement(0, (theirs,), theirs))
    await b.give_back(Placement(0, (theirs,), theirs))
    assert await a.take(Placement(0, (theirs,), theirs))


async def test_a_slot_pinned_by_two_replicas_in_an_outage_is_counted_when_it_returns() -> None:
    """B joined just before the outage: A had read B's heartbeat, B had not read A's, so B
    kept every slot while A kept its part - both pinned one slot. The store cannot undo that,
    but the replica whose lease is refused on reconnect counts it for the operator."""
    store, now, registry = Breakable(), [100.0], CollectorRegistry()
    a, b = replica(store, now, registry), replica(store, now)
    for r in (b, a):
        await r._heartbeat()  # B's list: B alone; A's: both
    store.down = True
    await a.refresh()
    await b.refresh()
    (both,) = [s for s in range(2) if await a.take(Placement(0, (s,), s))]  # A's part
    assert await b.take(Placement(0, (both,), both))  # B's part is every slot
    store.restart()
    await b._recover()
    await a._recover()
    conflicts = registry.get_sample_value("llama_cache_proxy_state_store_conflicts_total")
    assert conflicts == 1

"""The in-memory store's bound: what clients' traffic adds goes first, in passes that are rare."""

from __future__ import annotations

from unittest import mock

from proxy.state.memory import InMemoryStateStore


async def test_new_sessions_past_the_bound_sweep_rarely_and_spare_the_fleets_entries() -> None:
    """Past ``max_entries`` every new session key rebuilt the whole map (12 ms a request at
    100,000 entries), and the entries written first went first: the fleet's leases."""
    store = InMemoryStateStore(max_entries=100)
    for slot in range(4):
        assert await store.acquire_lease(("b0", slot), "me", 30.0, now=0.0)
    sweeps = []
    sweep = store._sweep

    def counted(now: float) -> None:
        sweeps.append(now)
        sweep(now)

    with mock.patch.object(store, "_sweep", counted):
        for i in range(1000):
            await store.set_affinity(f"key {i}", ("b0", i % 4), 3600.0, now=1.0)
    assert len(store._data) <= 100
    assert len(sweeps) <= 1000 // 10 + 1  # each frees a tenth of the room
    for slot in range(4):
        assert await store.renew_lease(("b0", slot), "me", 30.0, now=2.0)
    assert await store.get_affinity("key 999", now=2.0) == ("b0", 3)

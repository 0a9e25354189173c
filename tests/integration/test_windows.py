"""Recent-request windows through a short-lived local copy (``proxy.disk.windows``)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.server.fleet import Fleet
from proxy.disk.windows import FRESH, LIMIT, MODELS, OTHER, SEGMENTS, RecentWindows
from proxy.metrics import ProxyMetrics
from proxy.replicas.shared_state import SharedState
from proxy.state import InMemoryStateStore, SlotRecord


class Counting(InMemoryStateStore):
    reads = 0

    async def window(self, name: str, now: float) -> list[bytes]:
        self.reads += 1
        return await super().window(name, now)


def fp(i: int) -> Fingerprint:
    return Fingerprint((i, i + 1), (10, 20), 2)


async def test_a_replica_reads_a_window_once_per_fresh_period_and_sees_its_own_pushes() -> None:
    store = Counting()
    shared = [
        SharedState(store, Fleet(["b"]), ProxyMetrics(CollectorRegistry()), time.time, enabled=True)
        for _ in range(2)
    ]
    clock = [100.0]
    a, b = (RecentWindows(s, time.time, lambda: clock[0]) for s in shared)
    assert await a.read("m") == []
    for i in range(LIMIT + 3):
        await a.push("m", fp(i))
    await b.push("m", fp(1000))  # another replica's request
    expected = [fp(i) for i in reversed(range(LIMIT + 3))][:LIMIT]
    assert await a.read("m") == expected  # its own pushes at once, bounded as in the store
    assert store.reads == 1
    clock[0] += FRESH
    assert await a.read("m") == [fp(1000), *expected[: LIMIT - 1]]  # the other's, FRESH late
    assert store.reads == 2
    assert await b.read("m") == await a.read("m")


async def test_windows_are_bounded_whatever_models_and_prompts_clients_send() -> None:
    """A window keeps each fingerprint's first ``SEGMENTS`` segments, and a replica at most
    ``MODELS`` keys: a client naming a new model per request shares the one ``OTHER`` window
    (each had its own store entry, and a 50,000-message prompt kept all of it)."""
    store = InMemoryStateStore()
    shared = SharedState(
        store, Fleet(["b"]), ProxyMetrics(CollectorRegistry()), time.time, enabled=True
    )
    windows = RecentWindows(shared, time.time, time.monotonic)
    keys = {windows.key(f"model {i}") for i in range(MODELS + 50)}
    assert len(keys) == MODELS + 1
    assert OTHER in keys
    assert windows.key("model 0") == "model 0"  # (a key in use keeps its own window)
    n = SEGMENTS * 4
    long = Fingerprint(tuple(range(n)), tuple(range(1, n + 1)), 2)
    await windows.push(OTHER, long)
    (entry,) = await store.window(OTHER, time.time())
    assert len(SlotRecord.unpack(entry).hashes) == SEGMENTS

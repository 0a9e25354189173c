"""What the shared view costs a replica before each routing decision, by fleet and record size.

With Redis a replica reads every slot's lease and record before routing (``SharedState.
refresh``), and folds the records into its fleet. A record is the hash chain of what the
slot holds: one segment per chat message, or per 16-token block of a raw prompt, so a slot
holding a 32k-token raw prompt has a 2,000-segment record (24 KB). On a fresh redis-server
(started here), the same replica reads the same view two ways side by side: *every record*
(the view as it was: each read sends and parses every record) and *changed records* (the
view now: a record is sent only when newer than the one the replica holds; in the steady
state of a fleet that is the few slots whose requests ended since the last read, here one).

    python -m bench.shared_view [--reads 30]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from bench.results_io import print_markdown
from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.server.fleet import Fleet, SlotState
from proxy.metrics import ProxyMetrics
from proxy.replicas.shared_state import SharedState
from proxy.state import SlotView
from proxy.state.redis import RedisStateStore
from testbed.stack import RedisServer

CASES = [(4, 4, 20), (4, 4, 200), (4, 4, 2000), (16, 4, 200), (16, 4, 2000), (16, 4, 8000)]


class EveryRecord(RedisStateStore):
    """The view as it was: every record, whatever the reader holds."""

    async def view(self, refs: Sequence[Any], now: float, known: Any = None) -> SlotView:
        return await super().view(refs, now)


def _replica(store: RedisStateStore, labels: list[str], slots: int) -> SharedState:
    fleet = Fleet(labels)
    for backend in fleet.backends:
        backend.slots = [SlotState(i) for i in range(slots)]
    metrics = ProxyMetrics(CollectorRegistry())
    return SharedState(store, fleet, metrics, time.time, enabled=True)


async def _case(url: str, backends: int, slots: int, segments: int, reads: int) -> list[str]:
    labels = [f"http://10.0.0.{i}:8080" for i in range(backends)]
    writer_store = RedisStateStore(url)
    await writer_store._redis.flushdb()
    writer = _replica(writer_store, labels, slots)
    tokens = tuple(range(16, 16 * segments + 16, 16))
    for b in range(backends):
        for s in range(slots):
            hashes = tuple(range((b * slots + s) << 20, ((b * slots + s) << 20) + segments))
            await writer.publish(b, s, Fingerprint(hashes, tokens, 1), tokens[-1])
    cells = []
    for store in (EveryRecord(url), RedisStateStore(url)):
        reader = _replica(store, labels, slots)
        await reader.refresh()  # the first read brings every record either way
        times = []
        for i in range(reads):
            # one slot's request ended since the last read: its record is newer
            b, s = divmod(i % (backends * slots), slots)
            hashes = tuple(range(i << 40, (i << 40) + segments))
            await asyncio.sleep(0.002)  # a newer stamp, to the millisecond
            await writer.publish(b, s, Fingerprint(hashes, tokens, 1), tokens[-1])
            started = time.perf_counter()
            await reader.refresh()
            times.append((time.perf_counter() - started) * 1000)
            assert reader._fleet.backends[b].slots[s].content == Fingerprint(hashes, tokens, 1)
        cells.append(f"{statistics.median(times):.2f}")
        await store.close()
    await writer_store.close()
    ratio = float(cells[0]) / max(float(cells[1]), 1e-9)
    size = backends * slots * (12 * segments + 28) / 1024
    return [f"{backends}x{slots}", str(segments), f"{size:.0f}", *cells, f"{ratio:.1f}x"]


async def run(reads: int) -> None:
    redis = RedisServer().start()
    try:
        rows = [await _case(redis.url, b, s, g, reads) for b, s, g in CASES]
    finally:
        redis.stop()
    print(f"machine: {platform.machine()}, Python {platform.python_version()}; median of {reads}")
    print_markdown(
        [
            "fleet",
            "segments per record",
            "all records (KiB)",
            "every record (ms)",
            "changed records (ms)",
            "ratio",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reads", type=int, default=30)
    asyncio.run(run(parser.parse_args().reads))


if __name__ == "__main__":
    main()

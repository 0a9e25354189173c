"""Per-model recent-request windows (the disk tier's ``auto`` scope reads them), kept in the
state store so that every replica chooses scopes from the same recent traffic.

A window is read on every chat request, so each replica keeps the last read of a model's
window for ``FRESH`` seconds and prepends its own pushes to it, as the store does: one
replica alone sees exactly what the store holds, and several see each other's requests at
most ``FRESH`` seconds late (a scope is chosen from tens of recent requests, so a fraction
of a second changes nothing). Before, every chat request with Redis paid a round trip and
the parsing of up to ``LIMIT`` entries for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from proxy.core.prompt.fingerprint import Fingerprint
from proxy.replicas.shared_state import SharedState
from proxy.state import SlotRecord

LIMIT = 64  # fingerprints kept per model; auto:N looks at the newest N of them
FRESH = 0.5  # seconds a replica reuses its read of a window
KEPT = 1024  # local copies kept (one per model and tenant) before stale ones are dropped
TTL = 3600.0  # a model's window expires from the store after this long without a request


class RecentWindows:
    def __init__(
        self, shared: SharedState, wall: Callable[[], float], clock: Callable[[], float]
    ) -> None:
        self._shared = shared
        self._wall = wall
        self._clock = clock  # monotonic: how old a local copy is
        self._copies: dict[str, tuple[float, list[Fingerprint]]] = {}

    async def read(self, model: str) -> list[Fingerprint]:
        """The newest first, at most ``LIMIT``."""
        now = self._clock()
        found = self._copies.get(model)
        if found is not None and now - found[0] < FRESH:
            return found[1]
        store = self._shared.store
        raw = await self._shared.call("window", store.window(model, self._wall()), [])
        window = [_unpack(r) for r in raw]
        if len(self._copies) >= KEPT:
            self._copies = {k: v for k, v in self._copies.items() if now - v[0] < FRESH}
        self._copies[model] = (now, window)
        return window

    async def push(self, model: str, fp: Fingerprint) -> None:
        found = self._copies.get(model)
        if found is not None:
            self._copies[model] = (found[0], [fp, *found[1]][:LIMIT])
        wall = self._wall()
        entry = SlotRecord(fp.hashes, fp.tokens, fp.anchor, 0, wall).pack()
        push = self._shared.store.push_window(model, entry, LIMIT, TTL, wall)
        await self._shared.call("push_window", push, None)


@functools.lru_cache(maxsize=1024)  # a window's entries repeat from read to read
def _unpack(raw: bytes) -> Fingerprint:
    record = SlotRecord.unpack(raw)
    return Fingerprint(record.hashes, record.tokens, record.anchor)

"""In-memory StateStore: the embedded default for a single proxy replica (and the fake).

Plain dicts of (value, expiry); expiry is checked on read against the caller's ``now``, and
a sweep on writes keeps the map within ``max_entries``: past it, the expired entries go, then
the oldest written of those clients' traffic adds (session affinities, disk-tier windows,
releases: ``EVICTABLE``; leases, slot records and heartbeats are as many as the fleet has)
until a tenth of the room is free again, so one sweep's pass over the map is paid for by
that many writes. No locks: the event loop is one thread and no method awaits between
reading and writing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from proxy.state.base import LEFT, Beat, Known, SlotRecord, SlotRef, SlotView, newer, stamp_ms

EVICTABLE = frozenset({"aff", "win", "ret", "retd"})  # what clients' traffic adds
LOW_WATER = 0.9  # share of ``max_entries`` a sweep leaves (the rest: writes until the next)


class InMemoryStateStore:
    def __init__(self, *, max_entries: int = 100_000) -> None:
        self._data: dict[tuple[str, Any], tuple[Any, float]] = {}
        self._max = max_entries
        self._snapshots: dict[str, bytes] = {}

    def _get(self, key: tuple[str, Any], now: float) -> Any:
        found = self._data.get(key)
        if found is None or found[1] <= now:
            return None
        return found[0]

    def _set(self, key: tuple[str, Any], value: Any, ttl: float, now: float) -> None:
        self._data[key] = (value, now + ttl)
        if len(self._data) > self._max:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        live = {k: v for k, v in self._data.items() if v[1] > now}
        excess = len(live) - int(self._max * LOW_WATER)
        if excess > 0:  # the oldest written first (a dict keeps the order of first writes)
            for old in [k for k in live if k[0] in EVICTABLE][:excess]:
                del live[old]
        self._data = live

    async def get_affinity(self, key: str, now: float) -> SlotRef | None:
        value: SlotRef | None = self._get(("aff", key), now)
        return value

    async def set_affinity(self, key: str, ref: SlotRef, ttl: float, now: float) -> None:
        self._set(("aff", key), ref, ttl, now)

    async def acquire_lease(self, ref: SlotRef, owner: str, ttl: float, now: float) -> bool:
        holder = self._get(("lease", ref), now)
        if holder is not None and holder != owner:
            return False
        self._set(("lease", ref), owner, ttl, now)
        return True

    async def release_lease(self, ref: SlotRef, owner: str) -> None:
        found = self._data.get(("lease", ref))
        if found is not None and found[0] == owner:
            del self._data[("lease", ref)]

    async def renew_lease(self, ref: SlotRef, owner: str, ttl: float, now: float) -> bool:
        if self._get(("lease", ref), now) != owner:
            return False  # expired, released, or another owner's: never re-created here
        self._set(("lease", ref), owner, ttl, now)
        return True

    async def view(
        self, refs: Sequence[SlotRef], now: float, known: Known | None = None
    ) -> SlotView:
        owners = {ref: self._get(("lease", ref), now) for ref in refs}
        records = {ref: self._get(("slot", ref), now) for ref in refs}
        return SlotView(
            {ref: owner for ref, owner in owners.items() if owner is not None},
            {
                ref: record
                for ref, record in records.items()
                if record is not None and newer(record, ref, known)
            },
            now,
        )

    async def put_slot(self, ref: SlotRef, record: SlotRecord, ttl: float, now: float) -> float:
        previous = self._get(("slot", ref), now)
        stamp = stamp_ms(now)
        if previous is not None:
            stamp = max(stamp, stamp_ms(previous.updated_at) + 1)
        self._set(("slot", ref), replace(record, updated_at=stamp / 1000), ttl, now)
        return stamp / 1000

    async def clear_slots(self, refs: Sequence[SlotRef]) -> None:
        for ref in refs:
            self._data.pop(("slot", ref), None)

    async def heartbeat(
        self,
        owner: str,
        ttl: float,
        now: float,
        expires: float | None = None,
        previous: str | None = None,
    ) -> Beat:
        if previous is not None and previous != owner:
            self._data.pop(("replica", previous), None)
        self._replica(owner, ttl, now, expires)
        found = [(k[1], v[1]) for k, v in self._data.items() if k[0] == "replica" and v[1] > now]
        return Beat(now, sorted(found))

    def _replica(self, entry: str, ttl: float, now: float, expires: float | None) -> None:
        lapses = now + ttl if expires is None else min(now + ttl, expires)
        self._data[("replica", entry)] = (entry, lapses)

    async def leave(
        self,
        owner: str,
        ttl: float,
        now: float,
        mark: str | None = None,
        expires: float | None = None,
    ) -> None:
        self._data.pop(("replica", owner), None)
        self._replica(owner + LEFT if mark is None else mark, ttl, now, expires)

    async def push_window(
        self, name: str, entry: bytes, limit: int, ttl: float, now: float
    ) -> None:
        entries: list[bytes] = self._get(("win", name), now) or []
        self._set(("win", name), [entry, *entries][:limit], ttl, now)

    async def window(self, name: str, now: float) -> list[bytes]:
        entries: list[bytes] = self._get(("win", name), now) or []
        return list(entries)

    async def put_release(
        self, release: str, hashes: Sequence[int], ttl: float, now: float
    ) -> None:
        for key in hashes:
            self._set(("ret", key), (release, now), ttl, now)

    async def claim_release(
        self, hashes: Sequence[int], ttl: float, now: float
    ) -> tuple[str, float] | None:
        for key in reversed(hashes):
            found: tuple[str, float] | None = self._get(("ret", key), now)
            if found is not None and self._get(("retd", found[0]), now) is None:
                self._set(("retd", found[0]), True, ttl, now)
                return found[0], now - found[1]
        return None

    async def claimed(self, releases: Sequence[str], now: float) -> set[str]:
        return {r for r in releases if self._get(("retd", r), now) is not None}

    async def get_snapshots(self, keys: Sequence[str]) -> dict[str, bytes]:
        return {k: self._snapshots[k] for k in keys if k in self._snapshots}

    async def update_snapshots(
        self, key: str, change: Callable[[bytes | None], bytes | None]
    ) -> bool:
        value = change(self._snapshots.get(key))  # nothing awaited: no other writer between
        if value is None:
            self._snapshots.pop(key, None)
        else:
            self._snapshots[key] = value
        return True

    async def all_snapshots(self) -> dict[str, bytes]:
        return dict(self._snapshots)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None

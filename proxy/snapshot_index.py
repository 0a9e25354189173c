"""The snapshot index in the state store, and the disk budget.

Entries are ``core.snapshots.Snapshot`` lists under ``index_key(model, chain)``, at most one
per save directory, shared by every replica. A store outage reads as "no snapshot" (the
request is then served as if the disk tier were empty) and writes are dropped: the disk tier
never fails a request.

Budget: after every save, the directory's snapshots are summed and the least recently used
are evicted until they fit ``disk.max_bytes``. The proxy deletes the files of a directory it
can see (``slot_save_dir`` as the proxy sees it) and otherwise only forgets the entries (the
files stay where llama-server wrote them).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from proxy.core.fingerprint import Fingerprint
from proxy.core.snapshots import (
    Snapshot,
    evictions,
    index_key,
    lookup_keys,
    pack_entries,
    unpack_entries,
)
from proxy.metrics import ProxyMetrics
from proxy.shared_state import SharedState

log = logging.getLogger(__name__)


class SnapshotIndex:
    def __init__(
        self,
        shared: SharedState,
        metrics: ProxyMetrics,
        budget: int,
        paths: Callable[[str], Path | None],
    ) -> None:
        self._shared = shared
        self._store = shared.store
        self._metrics = metrics
        self._budget = budget
        self._paths = paths  # directory id -> the path the proxy sees, if any

    async def find(
        self, fp: Fingerprint, model_ids: Sequence[str], min_estimate: int
    ) -> dict[int, list[Snapshot]]:
        """segments -> snapshots of that prefix of ``fp`` (any directory, any listed model)."""
        wanted = {key: seg for m in model_ids for seg, key in lookup_keys(fp, m, min_estimate)}
        if not wanted:
            return {}
        found = await self._shared.call(
            "get_snapshots", self._store.get_snapshots(list(wanted)), {}
        )
        out: dict[int, list[Snapshot]] = {}
        for key, raw in found.items():
            out.setdefault(wanted[key], []).extend(unpack_entries(raw))
        return out

    async def put(self, snapshot: Snapshot) -> None:
        """Add or replace ``snapshot`` (one entry per directory under its key)."""
        await self._replace(snapshot, keep=True)

    async def forget(self, snapshot: Snapshot) -> None:
        await self._replace(snapshot, keep=False)

    async def _replace(self, snapshot: Snapshot, *, keep: bool) -> None:
        for chain in snapshot.keys:
            key = index_key(snapshot.layout.model_id, chain)
            got = await self._shared.call("get_snapshots", self._store.get_snapshots([key]), None)
            if got is None:
                return  # store down: the write would be blind
            entries = [e for e in unpack_entries(got.get(key)) if e.directory != snapshot.directory]
            if keep:
                entries.append(snapshot)
            if entries:
                put = self._store.put_snapshots(key, pack_entries(entries))
                await self._shared.call("put_snapshots", put, None)
            else:
                delete = self._store.delete_snapshots([key])
                await self._shared.call("delete_snapshots", delete, None)

    async def all(self) -> list[Snapshot]:
        found = await self._shared.call("all_snapshots", self._store.all_snapshots(), {})
        unique = {(e.directory, e.name): e for raw in found.values() for e in unpack_entries(raw)}
        return list(unique.values())

    async def enforce_budget(self, directory: str) -> int:
        """Evict least recently used snapshots of ``directory`` over the budget; returns how
        many were evicted. Also refreshes the size gauges."""
        everything = await self.all()
        mine = [e for e in everything if e.directory == directory]
        evicted = evictions(mine, self._budget)
        path = self._paths(directory)
        for snapshot in evicted:
            await self.forget(snapshot)
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path / snapshot.name)
            log.info(
                "[disk-cache] evicted %s (%d bytes) from %s",
                snapshot.name,
                snapshot.nbytes,
                directory,
            )
        self._metrics.disk_events.labels("eviction").inc(len(evicted))
        kept = [e for e in everything if e not in evicted]
        self._metrics.disk_entries.set(len(kept))
        self._metrics.disk_bytes.set(sum(e.nbytes for e in kept))
        return len(evicted)

    def file_exists(self, snapshot: Snapshot) -> bool | None:
        """Whether the file is there, when the proxy can see the directory (else None)."""
        path = self._paths(snapshot.directory)
        return None if path is None else (path / snapshot.name).is_file()

"""The snapshot index in the state store, and the disk budget.

Entries are ``core.disk.snapshots.Snapshot`` lists under ``index_key(model, chain)``, at most one
per save directory, shared by every replica. A store outage reads as "no snapshot" (the
request is then served as if the disk tier were empty) and writes are dropped: the disk tier
never fails a request.

Budget: after every save, the directory's snapshots are summed and the least recently used
are evicted until they fit ``disk.max_bytes``. The proxy deletes the files of a directory it
can see (``slot_save_dir`` as the proxy sees it) and otherwise only forgets the entries (the
files stay where llama-server wrote them). In a directory it can see, ``llp-*.bin`` files the
index does not list (strays: the store lost its data, or a replica stopped between a save
and its entry) count toward the budget and are deleted first, oldest first
(``core.disk.snapshots.stray_evictions``); a file younger than ``STRAY_GRACE_SECONDS`` is left
alone (its entry may be on its way). ``DiskTier`` runs this at start-up and periodically
too. Entries are read through ``core.disk.snapshots.unpack_entries``, which drops any name the
proxy would not generate, and a file is opened or deleted only if its resolved path is
directly inside the directory. File operations (listing, checking, deleting) run in a worker
thread, off the event loop; a periodic round that fails is logged and the next one runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from proxy.core.disk.snapshots import (
    Snapshot,
    Stray,
    belongs,
    evictions,
    index_key,
    lookup_keys,
    pack_entries,
    stray_evictions,
    unpack_entries,
    valid_name,
)
from proxy.core.prompt.fingerprint import Fingerprint
from proxy.metrics import ProxyMetrics
from proxy.replicas.shared_state import SharedState

log = logging.getLogger(__name__)
STRAY_GRACE_SECONDS = 60.0  # a save's file is on disk a moment before its index entry


def inside(directory: Path, name: str) -> Path | None:
    """``directory / name`` when ``name`` is a snapshot name and the path resolves to a
    file directly inside ``directory`` (no symlink out of it), else None."""
    if not valid_name(name):
        return None
    path = (directory / name).resolve()
    return path if path.parent == directory.resolve() else None


def list_strays(directory: Path, known: set[str], before: float) -> list[Stray]:
    """Snapshot files in ``directory`` not in ``known`` and last written before ``before``."""
    out = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if valid_name(entry.name) and entry.name not in known:
                    with contextlib.suppress(FileNotFoundError):
                        stat = entry.stat(follow_symlinks=False)
                        if entry.is_file(follow_symlinks=False) and stat.st_mtime < before:
                            out.append(Stray(entry.name, stat.st_size, stat.st_mtime))
    except OSError as exc:
        log.warning("[disk-cache] cannot list %s: %s", directory, exc)
    return out


def remove_files(directory: Path, names: Sequence[str]) -> None:
    """Delete the snapshot files ``names`` of ``directory`` (file I/O: run in a thread)."""
    for name in names:
        path = inside(directory, name)
        if path is not None:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("[disk-cache] cannot delete %s: %s", path, exc)


def is_snapshot_file(directory: Path, name: str) -> bool:
    """Whether ``name`` is a snapshot file directly inside ``directory`` (file I/O)."""
    path = inside(directory, name)
    return path is not None and path.is_file()


class SnapshotIndex:
    def __init__(
        self,
        shared: SharedState,
        metrics: ProxyMetrics,
        budget: int,
        paths: Callable[[str], Path | None],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._shared = shared
        self._store = shared.store
        self._metrics = metrics
        self._budget = budget
        self._paths = paths  # directory id -> the path the proxy sees, if any
        self._wall = wall  # the clock of file modification times

    async def find(
        self,
        fp: Fingerprint,
        model_ids: Sequence[str],
        min_estimate: int,
        max_estimate: int | None = None,
    ) -> dict[int, list[Snapshot]]:
        """segments -> snapshots of that prefix of ``fp`` (any directory, any listed model),
        of prefixes estimated at ``min_estimate`` to ``max_estimate`` tokens."""
        wanted = {
            key: (seg, m, fp.hashes[seg - 1])
            for m in model_ids
            for seg, key in lookup_keys(fp, m, min_estimate, max_estimate)
        }
        if not wanted:
            return {}
        found = await self._shared.call(
            "get_snapshots", self._store.get_snapshots(list(wanted)), {}
        )
        out: dict[int, list[Snapshot]] = {}
        for key, raw in found.items():
            seg, model, chain = wanted[key]
            kept = [e for e in unpack_entries(raw) if belongs(e, model, chain)]
            out.setdefault(seg, []).extend(kept)
        return out

    async def put(self, snapshot: Snapshot) -> None:
        """Add or replace ``snapshot`` (one entry per directory under its key)."""
        await self._replace(snapshot, keep=True)

    async def update(self, snapshot: Snapshot) -> None:
        """Replace ``snapshot``'s entry (touched, or marked bad) where it is still listed: one
        evicted meanwhile, its file deleted, is not listed again."""
        await self._replace(snapshot, keep=True, listed=True)

    async def forget(self, snapshot: Snapshot) -> None:
        await self._replace(snapshot, keep=False)

    async def _replace(self, snapshot: Snapshot, *, keep: bool, listed: bool = False) -> None:
        for chain in snapshot.keys:
            key = index_key(snapshot.layout.model_id, chain)
            change = partial(replaced, snapshot, keep=keep, listed=listed)
            done = await self._shared.call(
                "update_snapshots", self._store.update_snapshots(key, change), None
            )
            if done is None:
                return  # store down
            if not done:
                log.warning("[disk-cache] index entry of %s not written: contended", key)

    async def all(self) -> list[Snapshot] | None:
        """Every indexed snapshot (None when the store cannot be read)."""
        found = await self._shared.call("all_snapshots", self._store.all_snapshots(), None)
        if found is None:
            return None
        unique = {(e.directory, e.name): e for raw in found.values() for e in unpack_entries(raw)}
        return list(unique.values())

    async def enforce_budget(self, directory: str) -> int:
        """Evict least recently used snapshots of ``directory`` over the budget, strays
        first; returns how many were evicted. Also refreshes the size gauges."""
        everything = await self.all()
        if everything is None:
            return 0  # store down: every file would look like a stray
        mine = [e for e in everything if e.directory == directory]
        path = self._paths(directory)
        strays: list[Stray] = []
        if path is not None:
            known = {e.name for e in mine}
            before = self._wall() - STRAY_GRACE_SECONDS
            strays = await asyncio.to_thread(list_strays, path, known, before)
        doomed = stray_evictions(mine, strays, self._budget)
        kept_strays = sum(s.nbytes for s in strays) - sum(s.nbytes for s in doomed)
        evicted = evictions(mine, max(0, self._budget - kept_strays))
        await self._remove(path, [stray.name for stray in doomed])
        for stray in doomed:
            log.info("[disk-cache] deleted stray %s (%d bytes)", stray.name, stray.nbytes)
        self._metrics.disk_events.labels("stray").inc(len(doomed))
        for snapshot in evicted:
            await self.forget(snapshot)
            log.info(
                "[disk-cache] evicted %s (%d bytes) from %s",
                snapshot.name,
                snapshot.nbytes,
                directory,
            )
        await self._remove(path, [snapshot.name for snapshot in evicted])
        self._metrics.disk_events.labels("eviction").inc(len(evicted))
        kept = [e for e in everything if e not in evicted]
        self._metrics.disk_entries.set(len(kept))
        self._metrics.disk_bytes.set(sum(e.nbytes for e in kept))
        return len(evicted) + len(doomed)

    async def reconcile(self, directories: Sequence[str]) -> None:
        """Bring every directory within the budget, strays included (start-up)."""
        for directory in directories:
            await self.enforce_budget(directory)

    async def maintain(self, directories: Sequence[str], every: float) -> None:
        """``reconcile`` every ``every`` seconds (a task, cancelled at shutdown); a round
        that fails is logged and the next one runs."""
        while True:
            await asyncio.sleep(every)
            try:
                await self.reconcile(directories)
            except Exception:
                log.exception("[disk-cache] reconciling the save directories failed")

    @staticmethod
    async def _remove(directory: Path | None, names: Sequence[str]) -> None:
        if directory is not None and names:
            await asyncio.to_thread(remove_files, directory, names)

    async def file_exists(self, snapshot: Snapshot) -> bool | None:
        """Whether the file is there, when the proxy can see the directory (else None)."""
        directory = self._paths(snapshot.directory)
        if directory is None:
            return None
        return await asyncio.to_thread(is_snapshot_file, directory, snapshot.name)


def replaced(snapshot: Snapshot, raw: bytes | None, *, keep: bool, listed: bool) -> bytes | None:
    """A stored value (``raw``) with ``snapshot``'s directory's entry replaced by ``snapshot``
    (``keep``) or dropped; ``listed``: only where that very snapshot is still listed (one
    evicted meanwhile, its file deleted, is not listed again). None: nothing left."""
    found = unpack_entries(raw)
    if listed and not any(_same(e, snapshot) for e in found):
        return raw
    entries = [e for e in found if e.directory != snapshot.directory]
    if keep:
        entries.append(snapshot)
    return pack_entries(entries) if entries else None


def _same(entry: Snapshot, snapshot: Snapshot) -> bool:
    return entry.directory == snapshot.directory and entry.name == snapshot.name

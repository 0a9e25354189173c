"""Per-model recent-request windows (the disk tier's ``auto`` scope reads them), kept in the
state store so that every replica chooses scopes from the same recent traffic.

A window is read on every chat request, so each replica keeps the last read of a model's
window for ``FRESH`` seconds and prepends its own pushes to it, as the store does: one
replica alone sees exactly what the store holds, and several see each other's requests at
most ``FRESH`` seconds late (a scope is chosen from tens of recent requests, so a fraction
of a second changes nothing). Before, every chat request with Redis paid a round trip and
the parsing of up to ``LIMIT`` entries for it.

Bounded whatever clients send: a window keeps the first ``SEGMENTS`` segments of each
fingerprint (a stable prefix longer than that is cut there), and a replica keeps windows for
at most ``MODELS`` keys (a model, with its tenant under isolation: both are the client's to
name); a key past those shares one window, ``OTHER``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from proxy.core.prompt.fingerprint import Fingerprint
from proxy.replicas.shared_state import SharedState
from proxy.state import SlotRecord

LIMIT = 64  # fingerprints kept per model; auto:N looks at the newest N of them
SEGMENTS = 256  # segments (messages) of each fingerprint kept: a scope's prefix is cut there
MODELS = 64  # window keys a replica keeps (model, and tenant): the others share ``OTHER``
OTHER = "(other models)"  # (a client that names its model so shares it: no harm)
FRESH = 0.5  # seconds a replica reuses its read of a window
TTL = 3600.0  # a model's window expires from the store after this long without a request


class RecentWindows:
    def __init__(
        self, shared: SharedState, wall: Callable[[], float], clock: Callable[[], float]
    ) -> None:
        self._shared = shared
        self._wall = wall
        self._clock = clock  # monotonic: how old a local copy is
        self._copies: dict[str, tuple[float, list[Fingerprint]]] = {}
        self._keys: dict[str, float] = {}  # the window keys in use, with when last used

    def key(self, model: str) -> str:
        """The window ``model`` (and tenant) is kept under: its own while it is one of the
        ``MODELS`` used last, else ``OTHER``."""
        now = self._clock()
        if model not in self._keys and len(self._keys) >= MODELS:
            stale = [k for k, at in self._keys.items() if now - at > TTL]
            for k in stale:
                del self._keys[k]
                self._copies.pop(k, None)
            if len(self._keys) >= MODELS:
                return OTHER
        self._keys[model] = now
        return model

    async def read(self, model: str) -> list[Fingerprint]:
        """The newest first, at most ``LIMIT`` (``model``: a ``key``)."""
        now = self._clock()
        found = self._copies.get(model)
        if found is not None and now - found[0] < FRESH:
            return found[1]
        store = self._shared.store
        raw = await self._shared.call("window", store.window(model, self._wall()), [])
        window = [fp for fp in map(_unpack, raw) if fp is not None]
        self._copies[model] = (now, window)
        return window

    async def push(self, model: str, fp: Fingerprint) -> None:
        fp = _cut(fp)
        found = self._copies.get(model)
        if found is not None:
            self._copies[model] = (found[0], [fp, *found[1]][:LIMIT])
        wall = self._wall()
        entry = SlotRecord(fp.hashes, fp.tokens, fp.anchor, 0, wall).pack()
        push = self._shared.store.push_window(model, entry, LIMIT, TTL, wall)
        await self._shared.call("push_window", push, None)


def _cut(fp: Fingerprint) -> Fingerprint:
    """The first ``SEGMENTS`` segments of ``fp`` (a window's entry)."""
    if len(fp.hashes) <= SEGMENTS:
        return fp
    return Fingerprint(fp.hashes[:SEGMENTS], fp.tokens[:SEGMENTS], min(fp.anchor, SEGMENTS))


@functools.lru_cache(maxsize=1024)  # a window's entries repeat from read to read
def _unpack(raw: bytes) -> Fingerprint | None:
    """An entry's fingerprint; None for bytes that are no entry (another writer's)."""
    try:
        record = SlotRecord.unpack(raw)
    except ValueError:
        return None
    return Fingerprint(record.hashes, record.tokens, record.anchor)

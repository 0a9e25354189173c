"""Where a request that is not routed by prefix may run (slot-level placement).

Placement (``place``) for an ordinary request: among READY backends (minus ``avoid``) that
have an IDLE slot, pick the least busy (busy slots / total, then fewer busy, then index)
and, on it, the least recently used IDLE slot (then lowest id). A request that makes the
server choose slots itself (``n > 1`` children, endpoints that ignore ``id_slot``) needs an
exclusive placement: a READY backend whose slots are all IDLE, and it claims them all.
When nothing fits, the reason says whether any backend is READY (wait for a slot), only
LOADING (wait for the model), or none is up at all (fail now).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.core.server.fleet import (
    BackendPhase,
    BackendState,
    NoPlacement,
    Placement,
    SlotPhase,
)


@dataclass(frozen=True)
class Need:
    """What a request needs: one slot (maybe a given id), or a whole backend."""

    exclusive: bool = False
    slot: int | None = None
    avoid: frozenset[int] = frozenset()


def _fits(backend: BackendState, need: Need) -> bool:
    if backend.phase is not BackendPhase.READY or backend.index in need.avoid:
        return False
    if not backend.slots:
        return False
    if need.exclusive:
        return all(s.phase is SlotPhase.IDLE for s in backend.slots)
    if need.slot is not None:
        return need.slot < len(backend.slots) and backend.slots[need.slot].phase is SlotPhase.IDLE
    return bool(backend.idle_slots())


def _load_key(backend: BackendState) -> tuple[float, int, int]:
    busy = backend.busy_count()
    return (busy / len(backend.slots), busy, backend.index)


def place(backends: Sequence[BackendState], need: Need) -> Placement | NoPlacement:
    candidates = [b for b in backends if _fits(b, need)]
    if not candidates:
        return why_not(backends, need.avoid)
    backend = min(candidates, key=_load_key)
    if need.exclusive:
        return Placement(backend.index, tuple(s.id for s in backend.slots), None)
    if need.slot is not None:
        return Placement(backend.index, (need.slot,), need.slot)
    slot = min(backend.idle_slots(), key=lambda s: (s.last_used, s.id))
    return Placement(backend.index, (slot.id,), slot.id)


def pick_backend(backends: Sequence[BackendState], avoid: frozenset[int]) -> int | NoPlacement:
    """A READY backend for a request that uses no slot: the least busy one."""
    ready = [b for b in backends if b.phase is BackendPhase.READY and b.index not in avoid]
    if not ready:
        return why_not(backends, avoid)
    return min(ready, key=lambda b: (b.busy_count(), b.index)).index


def avoiding(
    backends: Sequence[BackendState], avoid: frozenset[int], failed: int
) -> frozenset[int]:
    """What a request retried after ``failed`` refused its connection avoids: that backend too,
    while another may serve it (READY, or about to be); else nothing more, so that the
    request goes to ``failed`` once a probe finds it back (a restart) rather than wait for
    none. (It is marked down meanwhile either way.)"""
    others = (BackendPhase.READY, BackendPhase.LOADING, BackendPhase.UNKNOWN)
    if any(b.phase in others for b in backends if b.index not in avoid and b.index != failed):
        return avoid | {failed}
    return avoid


def why_not(backends: Sequence[BackendState], avoid: frozenset[int]) -> NoPlacement:
    usable = [b for b in backends if b.index not in avoid]
    if any(b.phase is BackendPhase.READY for b in usable):
        return NoPlacement.BUSY
    waiting = (BackendPhase.LOADING, BackendPhase.UNKNOWN)
    if any(b.phase in waiting for b in usable):
        return NoPlacement.LOADING
    return NoPlacement.DOWN

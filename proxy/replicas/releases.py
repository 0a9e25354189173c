"""Releases shared between proxy replicas: when a response ends, the hashes its session's
next prompt will contain are registered under a release id (``owner:n``); the replica that
prompt reaches claims it (once, whichever replica asks), so how soon sessions come back is
measured across replicas (``core.routing.returns``), and a replica learns which of its releases
came back through another. Every call degrades like the rest of ``SharedState``: the store
down, nothing is registered and nothing found.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

from proxy.state import StateStore

T = TypeVar("T")


class Shared(Protocol):
    """What the releases use of ``SharedState``: its store, this replica's id, and how it
    degrades when the store is down (``call``)."""

    store: StateStore
    enabled: bool
    up: bool
    owner: str
    wall: Callable[[], float]

    async def call(self, op: str, call: Awaitable[T], default: T) -> T: ...


class SharedReleases:
    def __init__(self, shared: Shared) -> None:
        self._shared = shared

    async def put_release(self, release: int, hashes: Sequence[int], ttl: float) -> None:
        shared = self._shared
        if shared.enabled and shared.up:
            put = shared.store.put_release(f"{shared.owner}:{release}", hashes, ttl, shared.wall())
            await shared.call("put_release", put, None)

    async def claim_release(
        self, hashes: Sequence[int], ttl: float
    ) -> tuple[int | None, float] | None:
        """The release ``hashes`` continue, claimed: (its id if it is this replica's, the
        seconds since it); None when there is none or the store is down."""
        shared = self._shared
        found = await shared.call(
            "claim_release", shared.store.claim_release(hashes, ttl, shared.wall()), None
        )
        if found is None:
            return None
        owner, _, release = found[0].rpartition(":")
        ours = owner == shared.owner and release.isdecimal()  # (else another writer's value)
        return (int(release) if ours else None), max(0.0, found[1])

    async def claimed(self, releases: Sequence[int]) -> set[int] | None:
        """Which of this replica's releases some replica claimed; None when the store is down."""
        shared = self._shared
        ids = [f"{shared.owner}:{r}" for r in releases]
        found = await shared.call("claimed", shared.store.claimed(ids, shared.wall()), None)
        return None if found is None else {int(r.rpartition(":")[2]) for r in found}

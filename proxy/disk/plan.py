"""The disk tier's per-request and per-backend state (plain data shared by the tier and its
slot operations), and what the slot operations need of the tier (``Tier``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from proxy.core.disk.quota import WriteQuota
from proxy.core.disk.scope import Scope
from proxy.core.disk.snapshots import Layout, Lookup, Offer, Snapshot
from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.prompt.isolation import ANONYMOUS
from proxy.core.server.fleet import Fleet

if TYPE_CHECKING:
    from proxy.config.settings import Settings
    from proxy.disk.index import SnapshotIndex


@dataclass
class BackendDiskState:
    epoch: int = -1
    layout: Layout | None = None
    supported: bool = True  # False after a 501: no --slot-save-path
    restore_bps: float = 1e9  # measured from restores (EMA)


@dataclass
class DiskPlan:
    """One request's disk-tier state, from ``plan`` to ``after``."""

    scope: Scope
    model: str
    fp: Fingerprint
    lookup: Lookup
    window: list[Fingerprint] = field(default_factory=list)
    found: list[Snapshot] = field(default_factory=list)  # indexed prefixes of the request
    saved: dict[int, Snapshot] = field(default_factory=dict)  # chain -> written here
    restored: Snapshot | None = None
    restored_tokens: int = 0  # of the restored tokens, those the request should reuse
    warmed: int = 0  # prompt tokens a warm-up computed for the request (scoped save)
    # the scoped save filled the slot after the routing decision (a warm-up, a copy of another
    # slot, a snapshot another request saved restored): the decision's prediction is moot
    filled: bool = False
    tenant: str | None = None  # writes to slots are this tenant's (cache isolation)
    client: str = ANONYMOUS  # whose write cap its saves count against

    @property
    def offers(self) -> dict[int, Offer]:
        return self.lookup.offers

    def lookup_chain(self, chain: int) -> list[Snapshot]:
        """Known snapshots of the prefix ending at ``chain`` (usable ones: not bad)."""
        known = [s for s in self.found if s.chain == chain and not s.bad]
        return known + ([self.saved[chain]] if chain in self.saved else [])


class Tier(Protocol):
    """What the disk tier's slot operations (``disk_steps``) use of the tier."""

    settings: Settings
    fleet: Fleet
    index: SnapshotIndex
    quota: WriteQuota
    backends: list[BackendDiskState]
    parking: list[tuple[Fingerprint, asyncio.Future[None]]]  # parks in flight

    def now(self) -> float: ...

    def wall(self) -> float: ...

    def directory(self, index: int) -> str: ...

    async def lookup(self, fp: Fingerprint, tenant: str | None = None) -> Lookup: ...

    async def judge_restore(self, dp: DiskPlan, cached: int, prompt: int) -> None: ...

    def learn_restore(self, index: int, nbytes: int, ms: float) -> None: ...

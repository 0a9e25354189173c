"""This replica's heartbeat entry, and what it believes of the store's list of replicas.

With ``replicas.secret`` set, the entry this replica writes is signed with its expiry on the
store's clock (``core.replicas.auth``; the clock is estimated from the last read, which tells
the store's time: a first entry from a replica whose clock runs behind may lapse at once, and
the next one, half a second later, is right). A read keeps only the entries that verify:
anyone who can write to the store could add others, so those are ignored, counted
(``replica_entries_rejected``) and logged when they change. Without a secret, entries are
plain replica ids, believed as read; they then only tell who is live (``core.replicas.partition``):
no replica advertises a URL, so none forwards (``proxy.http.forwarding``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from proxy.core.replicas.auth import sign_entry, verify_entry
from proxy.core.replicas.homes import clashes
from proxy.metrics import ProxyMetrics
from proxy.state.base import LEFT, Beat

log = logging.getLogger(__name__)


class Roster:
    def __init__(
        self, owner: str, secret: bytes | None, metrics: ProxyMetrics, wall: Callable[[], float]
    ) -> None:
        self.owner = owner
        self._secret = secret
        self._metrics = metrics
        self._wall = wall
        self._offset = 0.0  # the store's clock minus this replica's, at the last read
        self.written: str | None = None  # the entry last written (the next one replaces it)
        self._rejected: frozenset[str] = frozenset()
        self._clashes: dict[str, list[str]] = {}  # URLs several live replicas advertise

    def entry(self, ttl: float, suffix: str = "") -> tuple[str, float | None]:
        """The entry to write now (``suffix``: ``LEFT`` for the mark of a replica that
        leaves), and the expiry it signed (None: unsigned)."""
        if self._secret is None:
            return self.owner + suffix, None
        expires = round(self._wall() + self._offset + ttl, 3)
        return sign_entry(self._secret, self.owner + suffix, expires), expires

    def read(
        self, beat: Beat, written: str, ttl: float
    ) -> tuple[list[str], set[str], dict[str, float]]:
        """The live replica ids of a heartbeat's read that wrote ``written``, those that
        left (listed with ``LEFT``), and when each live one last read the list (its entry's
        lapse less ``ttl``: an entry is written and the list read in one step; a signed
        expiry may lapse earlier, which only makes that read look older)."""
        self.written, self._offset = written, beat.now - self._wall()
        pairs = beat.entries if self._secret is None else self._verified(beat)
        found = [replica for replica, _ in pairs]
        read_at = {replica: lapse - ttl for replica, lapse in pairs}
        left = {r.removesuffix(LEFT) for r in found if r.endswith(LEFT)}
        live = sorted({r for r in found if not r.endswith(LEFT)})
        clashing = clashes(live)
        for url, ids in clashing.items() if clashing != self._clashes else ():
            log.warning(
                "replicas %s all advertise %s: none forwards or is forwarded to "
                "(give each its own replica_url)",
                ", ".join(ids),
                url,
            )
        self._clashes = clashing
        return live, left, {r: read_at[r] for r in live}

    def _verified(self, beat: Beat) -> list[tuple[str, float]]:
        assert self._secret is not None
        found: list[tuple[str, float]] = []
        rejected = set()
        for entry, score in beat.entries:
            try:
                replica = verify_entry(self._secret, entry, score)
            except Exception:  # (any entry at all is refused, never the whole read)
                log.exception("cannot check replica entry %r", entry[:120])
                replica = None
            if replica is None:
                rejected.add(entry)
            else:
                found.append((replica, score))
        self._metrics.replicas_rejected.set(len(rejected))
        if rejected and not rejected <= self._rejected:
            shown = ", ".join(repr(e[:120]) for e in sorted(rejected)[:5])
            log.warning(
                "ignoring %d replica entries in the store that are not signed with this "
                "replica's secret (another secret, or written by someone else): %s",
                len(rejected),
                shown,
            )
        self._rejected = frozenset(rejected)
        return found

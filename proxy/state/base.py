"""The state-store contract, shared by every proxy replica.

What it holds (every key has a TTL or a bound):
- *affinities*: cache_key -> (backend label, slot), refreshed on every keyed request;
- *slot records*: what each slot's KV holds (hash chain + token estimates, real KV length),
  written when a request finishes, so every replica routes on the same picture;
- *leases*: (backend, slot) -> owner, taken before a request is pinned and released after,
  with a TTL that frees the slot of a replica that died; ``acquire_lease`` is atomic
  (set-if-absent), so two replicas never pin one slot at once;
- *windows*: per model, the last N request fingerprints (bounded list), for the disk tier;
- *releases*: for a short while after a response, the hashes the session's next prompt
  will contain -> (release id, when), so whichever replica that prompt reaches can tell how
  soon the session came back (``core.routing.returns``); a release is claimed once;
- *replicas*: each live proxy replica's id, kept by a heartbeat with a TTL that returns
  the live ids, so that a replica that loses the store knows whether it is alone
  (``core.replicas.partition``); a replica that shuts down ``leave``s: it stops counting as live at
  once and is listed as ``id + LEFT`` for a while, so the others can tell it from one that
  lost the store (whose part of the fleet they keep off for a while); an id may be a signed
  entry (``core.replicas.auth``): ``expires`` then caps its lifetime (the store's clock, which
  ``Beat.now`` reads), ``previous`` is the entry it replaces, and every read lists each live
  entry with its score (when it lapses), since whoever writes to the store can set that;
- *snapshots*: the disk tier's index, index key -> packed entries (``core.disk.snapshots``),
  bounded by the disk budget (entries are deleted with their files), so it has no TTL. A key
  holds one entry per save directory, which replicas and backends write concurrently, so a
  value changes only through ``update_snapshots``: ``change(current)`` (None: absent), its
  result stored (None: deleted) unless the key changed meanwhile, and then ``change`` runs
  again on the newer value; it returns False when it gave up (``SNAPSHOT_ATTEMPTS``).

Semantics both implementations keep (``tests/contract``): a lease can be taken by one owner
at a time and renewed (extended, never re-created) or released only by it; expired entries
read as absent; a window keeps the newest ``limit`` entries, newest first; ``claim_release``
returns the unclaimed release registered under the last of the given hashes that has one (a
later registration of a hash replaces an earlier one) and marks it claimed, so it is
returned once, whichever replica asks; ``view`` leaves out a slot's record when it is not
newer than the one the caller says it has (``known``: its ``updated_at``, compared in whole
milliseconds, ``stamp_ms``), so a replica reads each record once rather than before every
request. Times are wall-clock seconds from the caller, except where replicas compare times
one another wrote — heartbeats (who is live), leaves and releases (how soon a session came
back), and slot records (which is newer, and how long ago a slot was last used): a shared
store judges those by its own clock, so replicas on machines whose clocks differ agree. (The
proxy beats every 0.5 s with a 1 s TTL: judged by the callers' clocks, a replica whose clock
ran more than 0.5 s ahead of a peer's dropped that peer from its live list on some beats, and
from 1 s ahead on every beat; ``tests/contract`` has the 2 s case.) ``claim_release``
therefore returns the seconds since the release was registered, not when. ``put_slot``
stamps a record itself (the ``updated_at`` given is ignored), later than the slot's previous
record even within one millisecond, and returns the stamp; ``view`` says what its clock read
(``SlotView.now``), so a record's age is ``now - updated_at``. (Stamped by its writer, a
record written by a replica whose clock ran behind the previous writer's read as older than
the record it replaced, and every replica that held that one skipped it.)
Every method may raise ``StateStoreUnavailable``; the proxy then routes on local state.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from proxy.core.prompt.fingerprint import Part

SlotRef = tuple[str, int]
Known = Mapping[SlotRef, float]  # per slot, the updated_at of the record the caller holds
SNAPSHOT_ATTEMPTS = 16  # tries of one snapshot-index change while other writers win (Redis)
LEFT = "!left"  # suffix of a replica id ``heartbeat`` lists for a while after it left


class StateStoreUnavailable(Exception):
    """The store cannot be reached; callers degrade to local state."""


@dataclass(frozen=True)
class SlotRecord:
    hashes: tuple[int, ...]
    tokens: tuple[int, ...]
    anchor: int
    n_tokens: int
    updated_at: float
    sealed: bool = False  # ``Fingerprint.sealed``: packed as the anchor's top bit
    # ``Fingerprint.users``: the segments that open a user message (where a sliding-window
    # or recurrent backend's checkpoints are); packed after the token counts, flagged by the
    # count's top bit, so a record without them reads as before
    users: tuple[int, ...] = ()
    # ``Fingerprint.parts``: the long system messages' pieces (where two prompts part inside
    # one); packed after the user segments, flagged by the count's next bit
    parts: tuple[Part, ...] = ()

    def content(self) -> tuple[Any, ...]:
        """The slot content's fields, in ``Fingerprint``'s order (hashes, tokens, anchor,
        sealed, users, parts)."""
        return self.hashes, self.tokens, self.anchor, self.sealed, self.users, self.parts

    def pack(self) -> bytes:
        """Little-endian: counts, hashes, token counts, the user-message segments (when any),
        the pieces (when any), then ``n_tokens`` and the stamp; the last ``STAMP_BYTES`` are
        the stamp, so a store can read or set it alone."""
        count = len(self.hashes) | bool(self.users) << 31 | bool(self.parts) << 30
        head = struct.pack("<II", count, self.anchor | self.sealed << 31)
        hashes, tokens = array("Q", self.hashes), array("I", self.tokens)
        users = array("I", self.users)
        if sys.byteorder != "little":
            hashes.byteswap()
            tokens.byteswap()
            users.byteswap()
        body = hashes.tobytes() + tokens.tobytes()
        if self.users:
            body += struct.pack("<I", len(users)) + users.tobytes()
        if self.parts:
            body += struct.pack("<I", len(self.parts))
            for segment, size, pieces in self.parts:
                body += struct.pack("<III", segment, size, len(pieces)) + pieces
        return head + body + struct.pack("<IQ", self.n_tokens, stamp_ms(self.updated_at))

    @classmethod
    def unpack(cls, raw: bytes) -> SlotRecord:
        """The record ``pack`` made; ``ValueError`` when ``raw`` is not one (any bytes
        someone wrote to the store)."""
        if len(raw) < 20:
            raise ValueError("not a slot record: too short")
        count, anchor = struct.unpack_from("<II", raw)
        flagged, pieced, count = bool(count >> 31), bool(count >> 30 & 1), count & 0x3FFFFFFF
        hashes_end = 8 + 8 * count
        end = tokens_end = hashes_end + 4 * count
        users = array("I")
        if flagged:
            if len(raw) < tokens_end + 4:
                raise ValueError("not a slot record: too short for its user segments")
            (n_users,) = struct.unpack_from("<I", raw, tokens_end)
            end = tokens_end + 4 + 4 * n_users
            users.frombytes(raw[tokens_end + 4 : end][: 4 * n_users])
        parts: list[Part] = []
        if pieced:
            end = _unpack_parts(raw, end, count, parts)
        if len(raw) != end + 12:
            raise ValueError("not a slot record: its length does not match its count")
        hashes = array("Q")
        hashes.frombytes(raw[8:hashes_end])
        tokens = array("I")
        tokens.frombytes(raw[hashes_end:tokens_end])
        n_tokens, updated = struct.unpack_from("<IQ", raw, end)
        if sys.byteorder != "little":
            hashes.byteswap()
            tokens.byteswap()
            users.byteswap()
        if any(u >= count for u in users):
            raise ValueError("not a slot record: a user segment past its segments")
        sealed, anchor = bool(anchor >> 31), anchor & 0x7FFFFFFF
        return cls(
            tuple(hashes),
            tuple(tokens),
            anchor,
            n_tokens,
            updated / 1000,
            sealed,
            tuple(users),
            tuple(parts),
        )


def _unpack_parts(raw: bytes, at: int, count: int, parts: list[Part]) -> int:
    """Read ``SlotRecord.pack``'s pieces from ``at`` into ``parts``; where they end."""
    if len(raw) < at + 4:
        raise ValueError("not a slot record: too short for its pieces")
    (n_parts,) = struct.unpack_from("<I", raw, at)
    at += 4
    for _ in range(n_parts):
        if len(raw) < at + 12:
            raise ValueError("not a slot record: too short for its pieces")
        segment, size, length = struct.unpack_from("<III", raw, at)
        at += 12
        if segment >= count or length % 8 or len(raw) < at + length:
            raise ValueError("not a slot record: pieces that do not fit it")
        parts.append((segment, size, raw[at : at + length]))
        at += length
    return at


STAMP_BYTES = 8  # a packed record ends with its stamp: little-endian milliseconds


def stamp_ms(updated_at: float) -> int:
    """A record's time as stored: whole milliseconds (``round``: a time read back from a
    stamp, ``ms / 1000``, gives the same stamp again)."""
    return round(updated_at * 1000)


def newer(record: SlotRecord, ref: SlotRef, known: Known | None) -> bool:
    """Whether ``view`` returns ``record``: the caller holds no record of ``ref``, or an
    older one."""
    return known is None or ref not in known or stamp_ms(record.updated_at) > stamp_ms(known[ref])


@dataclass(frozen=True)
class SlotView:
    """What a replica reads before routing, in one round trip: who leases each slot, and
    the last record of what each slot's KV holds (those newer than the caller's)."""

    owners: dict[SlotRef, str]
    records: dict[SlotRef, SlotRecord]
    # the store's clock when it was read, which records' stamps are in (None: the caller's)
    now: float | None = field(default=None, compare=False)


class Beat(NamedTuple):
    """A heartbeat's read: the store's clock, and each live entry with when it lapses."""

    now: float
    entries: list[tuple[str, float]]

    def ids(self) -> list[str]:
        return [entry for entry, _ in self.entries]


class StateStore(Protocol):
    async def get_affinity(self, key: str, now: float) -> SlotRef | None: ...

    async def set_affinity(self, key: str, ref: SlotRef, ttl: float, now: float) -> None: ...

    async def acquire_lease(self, ref: SlotRef, owner: str, ttl: float, now: float) -> bool: ...

    async def release_lease(self, ref: SlotRef, owner: str) -> None: ...

    async def renew_lease(self, ref: SlotRef, owner: str, ttl: float, now: float) -> bool: ...

    async def view(
        self, refs: Sequence[SlotRef], now: float, known: Known | None = None
    ) -> SlotView: ...

    async def put_slot(self, ref: SlotRef, record: SlotRecord, ttl: float, now: float) -> float: ...

    async def clear_slots(self, refs: Sequence[SlotRef]) -> None: ...

    async def push_window(
        self, name: str, entry: bytes, limit: int, ttl: float, now: float
    ) -> None: ...

    async def window(self, name: str, now: float) -> list[bytes]: ...

    async def put_release(
        self, release: str, hashes: Sequence[int], ttl: float, now: float
    ) -> None: ...

    async def claim_release(
        self, hashes: Sequence[int], ttl: float, now: float
    ) -> tuple[str, float] | None: ...

    async def claimed(self, releases: Sequence[str], now: float) -> set[str]: ...

    async def heartbeat(
        self,
        owner: str,
        ttl: float,
        now: float,
        expires: float | None = None,
        previous: str | None = None,
    ) -> Beat: ...

    async def leave(
        self,
        owner: str,
        ttl: float,
        now: float,
        mark: str | None = None,
        expires: float | None = None,
    ) -> None: ...

    async def get_snapshots(self, keys: Sequence[str]) -> dict[str, bytes]: ...

    async def update_snapshots(
        self, key: str, change: Callable[[bytes | None], bytes | None]
    ) -> bool: ...

    async def all_snapshots(self) -> dict[str, bytes]: ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...

"""Which slots a replica may pin while the shared state store is unreachable.

Leases live in the store, so without it a replica's leases are only local claims, and two
replicas routing on their own pictures would pin the same slot (on llama-server a request
pinned to a busy slot can overwrite the running generation's KV). So, while the store is
down, replicas that knew each other split the fleet instead of sharing it:

- every replica keeps a heartbeat in the store and reads the list of live replicas
  (``StateStore.heartbeat``) while it can; that last list is what it knows when the store
  goes away;
- number the slots of the whole fleet in configuration order, backend by backend
  (``position = slots of the backends before it + slot id``); slot ``position`` belongs to
  the replica ranked ``position mod n`` among the ``n`` sorted replica ids. With 2 replicas
  on 2 backends x 2 slots, each gets one slot of each backend, so both keep every backend;
- a replica that knew no other one keeps every slot, as on the embedded store; one whose
  heartbeat never reached the store (it started while the store was down) pins none: its
  peers may be pinning their parts of a split it is not in.

Every replica computes the same split from the same list, so the parts are disjoint.

A *partial* outage — one replica loses the store while the others still reach it — is
covered by fences. The others cannot see that replica's local claims, only that its
heartbeat lapsed (it lost the store, or died); so when a replica vanishes from the live list
without having left (a replica that shuts down says so, ``StateStore.leave``), each other
replica keeps off its part of the split it was last listed in (``Fence``: that list), for
``hold`` seconds or until it is live again (it leases its local claims as it reconnects,
before its next heartbeat), or until a live replica advertises the URL it advertised
(``core.replicas.homes``: one address cannot serve two processes, so it was restarted in its place
and the vanished one is dead — a compose container or a service restarted in place gets its
address back). The replica that lost the store claims its part only once its
peers must have read its heartbeat lapse (``Peers.claim_from``: ``HEARTBEAT_TTL`` +
``FENCE_MARGIN`` after its last heartbeat); until then it pins only slots of its part whose
leases it held as the store went away (``Peers.went_down``: they stand in the store, so peers
keep off them, until they expire; a leased slot of another's part is not pinned, since in a
full outage its owner cannot see the lease). A replica whose own store goes down later keeps
off fenced parts too. A partial outage longer than ``hold`` (or a crashed replica's part after
it) is shared again, seen busy only through ``/slots``; replicas whose last lists differ split
differently.

A replica whose peers may not know it yet pins nothing on local claims. A heartbeat writes
an entry and reads the list in one step, so a peer's entry tells when it last read the list
(its lapse less ``HEARTBEAT_TTL``, on the store's clock); a peer whose last read came before
this replica's first entry (since it started, or since the store came back) split the fleet
without it, maybe keeping every slot (``Peers.unknown_to``). Until a later read shows that
peer's next heartbeat, an outage leaves this replica only the slots its leases still hold:
within about a second of a start or of the store's return, the two would otherwise pin the
same slots.

A fence acts at once but is *reported* (logged; counted by the gauge behind the
``ReplicaLapsed`` alert) only once it has stood ``HEARTBEAT_TTL``: a restarted store lists no
heartbeats, so the first replica back would otherwise report every peer that reconnects a
maintenance round after it (the Redis-down alert covers that outage).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from proxy.core.replicas.homes import url_of

HEARTBEAT_TTL = 1.0  # seconds a replica counts as live after its last heartbeat (beats: 0.5 s)
# after that, until peers surely read the lapse (a maintenance round, and clock skew)
FENCE_MARGIN = 0.75
# a lease held as the store went down stands its TTL from its last renewal, which was up to
# a maintenance round and a timed-out call before the outage was noticed
STALE_MARGIN = 3.0
Ref = tuple[str, int]  # (backend label, slot)


def owns(
    backend: int, slot: int, slot_counts: Sequence[int], replicas: Sequence[str], me: str
) -> bool:
    """Whether replica ``me`` may pin ``slot`` of ``backend`` while the store is down;
    ``slot_counts``: slots per backend, in configuration order; ``replicas``: the live
    replica ids last read from the store."""
    peers = sorted(set(replicas) | {me})
    if len(peers) < 2:
        return True
    position = sum(slot_counts[:backend]) + slot
    return peers[position % len(peers)] == me


@dataclass(frozen=True)
class Fence:
    """A replica that vanished from the live list without leaving, fenced from ``since``:
    it may have lost the store and pin its part of the split of ``peers`` (the list it was
    last seen in) on local claims."""

    replica: str
    since: float
    peers: tuple[str, ...]


def fences(
    before: Sequence[str],
    live: Collection[str],
    left: Collection[str],
    current: Mapping[str, Fence],
    me: str,
    now: float,
    hold: float,
) -> dict[str, Fence]:
    """The fences after a heartbeat read ``live`` (the list before it: ``before``; replicas
    that shut down: ``left``): one per replica of ``before`` gone from ``live`` without
    leaving, kept until it is live again, another live replica advertises its URL (it was
    restarted there) or ``hold`` seconds have passed."""
    taken = {url_of(r) for r in live} - {None}

    def gone(replica: str) -> bool:  # dead or lost the store, not replaced
        return replica not in live and url_of(replica) not in taken

    kept = {r: f for r, f in current.items() if gone(r) and now < f.since + hold}
    for replica in before:
        if replica != me and gone(replica) and replica not in left and replica not in kept:
            kept[replica] = Fence(replica, now, tuple(before))
    return kept


def fenced(
    backend: int,
    slot: int,
    slot_counts: Sequence[int],
    active: Iterable[Fence],
    now: float,
    hold: float,
) -> bool:
    """Whether ``slot`` of ``backend`` is in the part of a fenced replica."""
    return any(
        now < f.since + hold and owns(backend, slot, slot_counts, f.peers, f.replica)
        for f in active
    )


@dataclass
class Peers:
    """What replica ``me`` knows of the others, from its heartbeats (times: its clock)."""

    me: str
    hold: float  # how long a vanished replica's part is fenced (the lease TTL)
    live: list[str] = field(default_factory=list)  # as last read (split by in an outage)
    beat_at: float = float("-inf")  # when a heartbeat last reached the store
    rejoined: float = -HEARTBEAT_TTL  # when the store last came back
    fences: dict[str, Fence] = field(default_factory=dict)
    stale: dict[Ref, float] = field(default_factory=dict)  # leases left in the store: until
    reported: set[str] = field(default_factory=set)  # fenced replicas reported as lapsed
    joined: float | None = None  # the store's clock at this replica's first heartbeat there
    unknown_to: frozenset[str] = frozenset()  # listed peers whose last read predates it

    def went_down(self, held: Iterable[Ref], now: float) -> None:
        """The store went away with these slots leased: the leases stand in it (peers keep
        off) until they expire, so the slots stay this replica's until then."""
        self.stale = {ref: now + self.hold - STALE_MARGIN for ref in held}

    def may_claim(
        self, ref: Ref, index: int, slot_counts: Sequence[int], now: float
    ) -> bool | None:
        """Whether the store being down this replica may pin slot ``ref`` (of backend
        ``index``): one of its part whose lease still stands, or any of its part once its
        peers must have fenced it; None: not yet (until ``claim_from``). None at all before
        its first heartbeat reached the store: it cannot know which slots its peers pin."""
        if self.beat_at == float("-inf"):
            return False  # never reached the store: which slots its peers pin is not known
        if now < self.stale.get(ref, float("-inf")) and self.owns(index, ref[1], slot_counts):
            return True  # (another's part: in a full outage its owner cannot see the lease)
        if self.unknown_to:  # a peer split the fleet without this replica
            return False
        if now < self.claim_from():
            return None
        return self.owns(index, ref[1], slot_counts)

    def beat(
        self,
        live: list[str],
        left: Collection[str],
        now: float,
        read_at: Mapping[str, float] | None = None,
        store_now: float | None = None,
    ) -> list[Fence]:
        """A heartbeat read ``live`` (and ``left``: replicas that shut down); returns the
        fences to report from now: those that have stood ``HEARTBEAT_TTL``. The list that
        split the fleet in an outage is kept for a heartbeat period after the store comes
        back (``settling``). ``read_at``: when each listed replica last read the list, and
        ``store_now``: when this read was, both on the store's clock (``unknown_to``)."""
        self.beat_at = now
        if store_now is not None:
            joined = self.joined = store_now if self.joined is None else self.joined
            seen = read_at or {}
            self.unknown_to = frozenset(
                r for r in live if r != self.me and seen.get(r, float("-inf")) < joined
            )
        self.fences = fences(self.live, live, left, self.fences, self.me, now, self.hold)
        if not self.settling(now):
            self.live = live
        self.reported &= self.fences.keys()
        due = [
            f
            for f in self.fences.values()
            if f.replica not in self.reported and now >= f.since + HEARTBEAT_TTL
        ]
        self.reported |= {f.replica for f in due}
        return due

    def settling(self, now: float) -> bool:
        """Just back from an outage: peers may not have leased their outage pins yet."""
        return now < self.rejoined + HEARTBEAT_TTL

    def owns(self, backend: int, slot: int, slot_counts: Sequence[int]) -> bool:
        return owns(backend, slot, slot_counts, self.live, self.me)

    def fenced(self, backend: int, slot: int, slot_counts: Sequence[int], now: float) -> bool:
        return fenced(backend, slot, slot_counts, self.fences.values(), now, self.hold)

    def keep_off(self, backend: int, slot: int, slot_counts: Sequence[int], now: float) -> bool:
        """Not to be leased now: a fenced replica's part, or while ``settling`` any slot not
        of this replica's part (peers may not have leased their outage pins yet)."""
        if self.fenced(backend, slot, slot_counts, now):
            return True
        return self.settling(now) and not self.owns(backend, slot, slot_counts)

    def claim_from(self) -> float:
        """When this replica's outage claims may start: at once if it knew no peer, else once
        every peer must have read its heartbeat lapse (and fenced its part)."""
        if not any(r != self.me for r in self.live):
            return float("-inf")
        return self.beat_at + HEARTBEAT_TTL + FENCE_MARGIN

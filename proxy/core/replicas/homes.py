"""Which proxy replica schedules each backend's requests (its *home*).

Replicas sharing one store never pin one slot at once (leases), but each keeps its own queue
of requests waiting for a slot. When requests of two replicas wait for the same slot, neither
queue knows the other's: the slot goes to whichever replica's lease lands first, not to the
waiter whose prefix it holds, and a session's turn waits behind strangers queued elsewhere.

So every backend has one home replica, which alone places requests on its slots. A replica
that would place a request on a backend, or wait for one of its slots, forwards the request to
that backend's home; it routes it again, on its own backends and its own queue. A forwarded
request is never forwarded again, so there are no loops. A replica with none of its own
backends up places on the others rather than fail (measured: bench/HISTORY.md).

Homes: each replica that can be forwarded to advertises its URL in its replica id
(``<token>@<url>``, listed by the store's heartbeats). Among the live advertising replicas,
sorted by URL, backend ``i`` is homed at replica ``i mod n`` — with as many backends as
replicas, one each. A replica that restarts gets a new token but, at the same address, its
backends back, and the others keep theirs (sorted by id, a restarted replica could take
another place in the order and move every other replica's homes too). Every replica computes
the same split from the same list; two lists that differ for a heartbeat period only send a
request to a replica that routes it again. With fewer than two such replicas, or when this
replica does not advertise, every request is routed where it arrives. A URL that two live
replicas advertise (a misconfigured ``replica_url``, such as every replica set to the load
balancer's address) reaches neither for sure: those replicas do not count as advertisers, so
none is a home and none forwards (each routes what reaches it, as without a URL), rather
than send requests to a replica that does not schedule their backend.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from proxy.core.routing.decision import Decision
from proxy.core.server.fleet import NoPlacement

SEPARATOR = "@"


def replica_id(token: str, url: str | None) -> str:
    """A replica's id: ``token`` (unique per process), with its URL when it advertises one."""
    return token if url is None else f"{token}{SEPARATOR}{url}"


def url_of(replica: str) -> str | None:
    """The URL a replica id advertises, if any."""
    _, sep, url = replica.partition(SEPARATOR)
    return url if sep else None


def clashes(live: Iterable[str]) -> dict[str, list[str]]:
    """URLs more than one of the ``live`` replicas advertise, with those replicas (sorted)."""
    by_url: dict[str, list[str]] = {}
    for replica in sorted(set(live)):
        url = url_of(replica)
        if url is not None:
            by_url.setdefault(url, []).append(replica)
    return {url: ids for url, ids in by_url.items() if len(ids) > 1}


def advertisers(live: Iterable[str], me: str) -> list[str]:
    """The replicas homes are split between, sorted by URL: the live ones that advertise a
    URL no other live replica advertises, this one included when it does; fewer than two
    means no replica forwards."""
    if url_of(me) is None:
        return []
    ids = {r for r in live if url_of(r) is not None} | {me}
    shared = clashes(ids)
    if url_of(me) in shared:
        return []
    return sorted((r for r in ids if url_of(r) not in shared), key=lambda r: url_of(r) or "")


def home(
    backend: int, live: Iterable[str], me: str, unreachable: Collection[str] = ()
) -> str | None:
    """The URL of the replica that schedules ``backend``'s requests, or None to route here:
    the home is this replica, none is known, or it is ``unreachable`` (a URL that just failed
    to connect; the split is kept so other backends keep their homes)."""
    return home_among(backend, advertisers(live, me), me, unreachable)


def home_among(
    backend: int, replicas: Sequence[str], me: str, unreachable: Collection[str] = ()
) -> str | None:
    """``home``, given the split already worked out (``replicas``: ``advertisers``), so a
    request that asks for every backend's home works it out once."""
    if len(replicas) < 2:
        return None
    chosen = replicas[backend % len(replicas)]
    url = url_of(chosen)
    if chosen == me or url is None or url in unreachable:
        return None
    return url


def target(decision: Decision | NoPlacement) -> int | None:
    """The backend a routing decision places the request on, or waits for."""
    if isinstance(decision, NoPlacement):
        return None
    if decision.placement is not None:
        return decision.placement.backend
    return decision.wait_for[0] if decision.wait_for is not None else None

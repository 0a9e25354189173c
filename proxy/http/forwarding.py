"""Forward a request to the replica that schedules its backend, the shell of
``core.replicas.homes``.

- *Which URL this replica advertises* (``replica_url``, only with a shared store): a URL as
  configured; ``auto`` takes ``listen``, or with a wildcard listen address the local address
  of the route to Redis, so every container or pod of one deployment advertises its own;
  ``off`` (or no address peers could use: a loopback listen with a remote Redis) advertises
  none, and this replica then neither forwards nor is forwarded to.
- *Trust* (``core.replicas.auth``): only with ``replicas.secret`` set, shared by every replica;
  without it no replica advertises a URL (so none forwards, or is forwarded to), since
  whoever can write to the store could otherwise list an address of theirs as a replica and
  receive clients' prompts and credentials. Heartbeat entries that do not verify are ignored
  (``proxy.replicas.roster``); a replica is forwarded to only if its URL is on ``replicas.allow``;
  the mark a forwarded request carries is signed for that request, and one that does not verify
  is dropped and the request treated as a client's (counted ``rejected``).
- *When*: a prefix-routed request that did not come from another replica, while the store is
  up, whose target backend (``Router.target``, before it waits; an equal choice goes to a
  backend this replica schedules) is homed at another live replica. The request goes there
  with ``X-Cache-Forwarded-By`` (so it is not forwarded again), the bytes the client sent,
  its path and query string as sent, and the same request id; the home's response, headers
  included, is relayed byte for byte. Its usage, and the request itself (``requests_total``,
  ``request_duration_seconds``), are counted by the home only, so metrics summed over
  replicas count every request once; the replica that relayed it counts it in
  ``forwarded_requests_total{outcome="sent"}``.
- *Where a replica places*: only on the backends it is home to (``foreign``: the others are
  avoided while it routes and re-decides a queued request), unless none of them is up.
- *Failure*: a home that cannot be connected to is skipped for ``RETRY_SECONDS`` and the
  request is routed here (nothing was sent). A replica that died leaves the heartbeat list
  within ``HEARTBEAT_TTL`` anyway; any failure after the request was sent is the client's
  answer, as for a backend.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

from aiohttp import web

from proxy.config.settings import ReplicaSettings, Settings
from proxy.core.prompt.headers import FORWARDED_BY, upstream_request_headers
from proxy.core.replicas.auth import allowed, request_parts, sign_forward, verify_forward
from proxy.core.replicas.homes import advertisers, home_among, url_of
from proxy.core.server.fleet import BackendPhase, Fleet
from proxy.http.middleware import RECORD
from proxy.http.streaming import relay
from proxy.metrics import ProxyMetrics
from proxy.replicas.shared_state import SharedState
from proxy.upstream import ROUTES, LlamaServerClient, UpstreamConnectError

log = logging.getLogger(__name__)
RETRY_SECONDS = 5.0
_WILDCARD = {"0.0.0.0", "::", ""}


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _address_towards(host: str, port: int) -> str | None:
    """The local address this host uses to reach ``host`` (no packet is sent)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def advertised_url(settings: Settings) -> str | None:
    """The URL peers forward to this replica at, or None (see the module docstring)."""
    if settings.redis_url is None or settings.replica_url == "off":
        return None
    if settings.replicas.secret is None:
        log.warning("replicas.secret is not set: replicas do not forward requests to each other")
        return None
    if settings.replica_url != "auto":
        return settings.replica_url
    redis = urlsplit(settings.redis_url)
    remote = redis.hostname is not None and not _loopback(redis.hostname)
    host = settings.host.strip("[]")
    if host in _WILDCARD:
        found = _address_towards(redis.hostname, redis.port or 6379) if redis.hostname else None
        host = found or "127.0.0.1"
    if remote and _loopback(host):
        log.warning("replica_url auto: listening on %s, which peers cannot reach", host)
        return None
    return f"http://{f'[{host}]' if ':' in host else host}:{settings.port}"


class Forwarder:
    def __init__(
        self,
        shared: SharedState,
        fleet: Fleet,
        metrics: ProxyMetrics,
        clock: Callable[[], float],
        trust: ReplicaSettings,
        client: LlamaServerClient,
        head_seconds: float,
    ) -> None:
        """``head_seconds``: how long a home may take to send an answer's headers: its
        queue's bound, then its backend's read timeout."""
        self._head_seconds = head_seconds
        self._secret = trust.key
        self._allow, self._window = trust.allow, trust.forward_window_seconds
        self._refused: set[str] = set()  # URLs off the allowlist, logged once each
        self._shared = shared
        self._backends = fleet.backends
        self._metrics = metrics
        self._clock = clock
        self._unreachable: dict[str, float] = {}  # URL -> until
        self._client = client

    def _homes(self) -> Callable[[int], str | None] | None:
        """Each backend's home URL (None: this replica), or None when not forwarding."""
        shared = self._shared
        if not shared.enabled or not shared.up:
            return None
        replicas = advertisers(self._allowed(shared.peers.live), shared.owner)
        if len(replicas) < 2:
            return None  # alone: every backend is this replica's (and no target is needed)
        now = self._clock()
        down = {url for url, until in self._unreachable.items() if now < until}
        return lambda index: home_among(index, replicas, shared.owner, down)

    def _allowed(self, live: list[str]) -> list[str]:
        """The live replicas that may be forwarded to: on the allowlist, or advertising no
        URL (``advertisers`` leaves those out)."""
        kept = []
        for replica in live:
            url = url_of(replica)
            if url is None or replica == self._shared.owner or allowed(url, self._allow):
                kept.append(replica)
            elif url not in self._refused and len(self._refused) < 1000:
                self._refused.add(url)
                log.warning("replica at %s is not on replicas.allow: not forwarded to", url)
        return kept

    def foreign(self) -> frozenset[int]:
        """Backends another replica schedules: this one does not place requests on them (it
        forwards those to their home), unless none of its own is up."""
        return self._foreign(self._homes())

    def _foreign(self, homes: Callable[[int], str | None] | None) -> frozenset[int]:
        if homes is None:
            return frozenset()
        foreign = frozenset(b.index for b in self._backends if homes(b.index) is not None)
        own = [b for b in self._backends if b.index not in foreign]
        if all(b.phase is BackendPhase.DOWN for b in own):
            return frozenset()
        return foreign

    def _mark(self, request: web.Request, body: bytes, request_id: str) -> tuple[str, ...]:
        return request_parts(request_id, request.method, request.rel_url.raw_path_qs, body)

    def received(self, request: web.Request, body: bytes) -> bool:
        """Whether another replica sent this request: its mark verifies (see the module
        docstring). A mark that does not is counted ``rejected``; the request is then a
        client's (the mark is never passed on: ``core.prompt.headers`` drops it)."""
        mark = request.headers.get(FORWARDED_BY)
        if mark is None:
            return False
        parts = self._mark(request, body, request.headers.get("X-Request-Id", ""))
        wall = self._shared.wall()
        if self._secret is None or not verify_forward(
            self._secret, mark, parts, wall, self._window
        ):
            self._metrics.forwards.labels("rejected").inc()
            return False
        self._metrics.forwards.labels("received").inc()
        return True

    def home(
        self, request: web.Request, body: bytes, backend: Callable[[frozenset[int]], int | None]
    ) -> str | None:
        """The URL to forward this request to, or None to route it here; ``backend``: where
        it would go, given the backends other replicas schedule (which lose ties: no hop for
        an equal choice; only asked when forwarding is possible)."""
        if self.received(request, body):
            return None
        homes = self._homes()
        index = backend(self._foreign(homes)) if homes is not None else None
        return None if homes is None or index is None else homes(index)

    async def forward(
        self, request: web.Request, body: bytes, backend: Callable[[frozenset[int]], int | None]
    ) -> web.StreamResponse | None:
        """The response of the home replica this request was relayed to, or None to route
        it here (``home``, ``send``)."""
        url = self.home(request, body, backend)
        return None if url is None else await self.send(request, body, url)

    async def send(self, request: web.Request, body: bytes, url: str) -> web.StreamResponse | None:
        """Relay the request through the replica at ``url``; None when it cannot be reached."""
        record = request[RECORD]
        headers = [
            (name, value)
            for name, value in upstream_request_headers(request.headers.items())
            if name.lower() != "x-request-id"
        ]
        assert self._secret is not None  # (no URL is advertised without it: no home is known)
        parts = self._mark(request, body, record.request_id)
        mark = sign_forward(self._secret, self._shared.owner, self._shared.wall(), parts)
        headers += [(FORWARDED_BY, mark), ("X-Request-Id", record.request_id)]
        try:
            async with self._client.send(
                url,
                request.rel_url.raw_path_qs,  # (the query string too, as the mark covers)
                method=request.method,
                body=body,
                headers=headers,
                head_seconds=self._head_seconds,
            ) as upstream:
                self._metrics.forwards.labels("sent").inc()
                record.backend, record.relayed = f"replica:{url}", True
                # the home counted its usage; this replica's log line shows it too; its
                # answer to an Anthropic request is translated already, but an error this
                # replica adds mid-stream must take that shape too
                route = ROUTES.get(request.path)
                outcome = await relay(
                    request,
                    upstream,
                    {},
                    self._clock,
                    lambda done: record.counted(done.usage),
                    anthropic=route is not None and route.via is not None,
                    translate=False,
                )
        except UpstreamConnectError as exc:
            self._unreachable[url] = self._clock() + RETRY_SECONDS
            self._metrics.forwards.labels("unreachable").inc()
            log.warning("replica %s unreachable (%s): routing here", url, exc)
            return None
        return outcome.response

"""The composition root: ``create_app`` builds and wires every collaborator.

Resources with a lifetime (the upstream ``ClientSession``, the prober task, drain tasks) live
in ``cleanup_ctx``. At start-up every backend is probed once before the first request is
served, then the prober runs in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry

from proxy.backends.health import Prober
from proxy.backends.reuse_probe import ReuseProber
from proxy.backends.scheduler import Scheduler
from proxy.config.settings import Settings
from proxy.core.server.fleet import BackendPhase, Fleet
from proxy.disk.tier import DiskTier
from proxy.http.admin import AdminHandlers
from proxy.http.api_keys import make_key_check
from proxy.http.cors import CorsMirror
from proxy.http.forwarding import Forwarder, advertised_url
from proxy.http.handlers import ProxyHandlers
from proxy.http.middleware import Handler, ProtocolLog, make_middleware, make_preflight
from proxy.http.status import StatusHandlers
from proxy.http.streaming import STREAMS
from proxy.metrics import ProxyMetrics
from proxy.offload import Offload
from proxy.replicas.shared_state import SharedState
from proxy.routing.churn_tracker import ChurnTracker
from proxy.routing.router import Router
from proxy.routing.tokenizer import TokenCounter
from proxy.state import InMemoryStateStore, StateStore
from proxy.state.redis import RedisStateStore
from proxy.upstream import (
    HEADERS_MAX,
    HEALTH,
    PUBLIC,
    REFUSED,
    ROUTES,
    SERVER_SOFTWARE,
    TARGET_MAX_BYTES,
    LlamaServerClient,
)

HANDLERS = web.AppKey("handlers", ProxyHandlers)
PROBER = web.AppKey("prober", Prober)
METRICS = web.AppKey("metrics", ProxyMetrics)
SCHEDULER = web.AppKey("scheduler", Scheduler)
STOP_SECONDS = 3.0  # at shutdown, how long background tasks get to end
# a body answered unread (413, 415: Connection: close) is discarded, never decoded, for at
# most this long before the close (aiohttp's default is 10 s; closing at once with unread
# bytes resets the connection, and the client may lose the answer)
LINGER_SECONDS = 1.0

DOWN_PROBE_ROUNDS = 3  # probe rounds (health.interval_seconds) a fleet may be all down


def create_app(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    store: StateStore | None = None,
    probe_loop: bool = True,
) -> web.Application:
    metrics = ProxyMetrics(registry or CollectorRegistry())
    metrics.zero([b.label for b in settings.backends])
    fleet = Fleet(
        [b.label for b in settings.backends],
        [b.kv_reuse == "exact" for b in settings.backends],
        [b.ram_cache for b in settings.backends],
        ram_tokens=[b.ram_cache_tokens for b in settings.backends],
        idle_saves=[b.cache_idle_slots for b in settings.backends],
        unified=[b.kv_unified is True for b in settings.backends],
        # (under cache isolation a request keeping under half of its slot reuses nothing; with
        # slots not pinned the server may run the request in another slot than the primer's)
        primes=settings.isolation.mode == "off" and settings.routing.pin_slots,
    )
    for state, backend in zip(fleet.backends, settings.backends, strict=True):
        state.reuse_known = backend.kv_reuse != "auto"  # probed (``reuse_probe``)
    # a restarting llama-server listens (answering 503 while it loads) within a few probe
    # rounds: a fleet all down for longer is not restarting, and waiting requests get a 503
    down = DOWN_PROBE_ROUNDS * settings.health.interval_seconds + settings.timeouts.probe_seconds
    scheduler = Scheduler(fleet, settings.queue, metrics, clock, down)
    keys = {b.base_url: b.key for b in settings.backends}
    labels = {b.base_url: b.label for b in settings.backends}

    def opened(base_url: str) -> None:  # (a replica's URL, when forwarding, is not counted)
        if base_url in labels:
            metrics.upstream_connections.labels(labels[base_url]).inc()

    client = LlamaServerClient(None, settings.timeouts, keys, opened)  # pool opens at startup
    if store is None:
        store = RedisStateStore(settings.redis_url) if settings.redis_url else InMemoryStateStore()
    shared = SharedState(
        store,
        fleet,
        metrics,
        wall,
        enabled=settings.redis_url is not None,
        record_ttl=settings.routing.affinity_ttl_seconds,
        lease_ttl=settings.routing.lease_ttl_seconds,
        clock=clock,
        url=advertised_url(settings),
        secret=settings.replicas.key,
        on_down=lambda backends, after: prober.drain_all(backends, after),
    )
    prober = Prober(
        settings,
        client,
        scheduler,
        metrics,
        clock,
        shared.forget_backend,
        on_ready=lambda index: reuse.schedule(index),
    )
    reuse = ReuseProber(settings, scheduler, client, prober.drain, shared)
    disk = DiskTier(settings, fleet, shared, metrics, wall, clock, client)
    offload = Offload()  # large bodies: parsed, fingerprinted and encoded in worker threads
    churn = ChurnTracker(metrics, wall)
    tokens = (
        _backend_counter(client, settings, fleet)
        if settings.routing.tokenizer == "backend"
        else None
    )
    router = Router(
        settings,
        fleet,
        shared,
        TokenCounter(),
        metrics,
        clock,
        offload,
        scheduler,
        disk,
        churn,
        tokens,
    )
    # a home may queue the request for a slot before its backend's answer starts
    head = settings.queue.max_wait_seconds + settings.timeouts.read_seconds
    forwarder = Forwarder(shared, fleet, metrics, clock, settings.replicas, client, head)
    handlers = ProxyHandlers(
        settings,
        scheduler,
        router,
        shared,
        metrics,
        clock,
        disk,
        forwarder,
        offload,
        client,
        prober,
    )

    cors = CorsMirror(client.probe_cors)  # what the backends give any origin, as probed
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=_middlewares(settings, metrics, clock, handlers.preflight, cors),
        handler_args={
            "logger": ProtocolLog(logging.getLogger("aiohttp.server")),
            "auto_decompress": False,  # an encoded body is refused (415), never inflated
            "lingering_time": LINGER_SECONDS,
            "max_line_size": TARGET_MAX_BYTES,
            "max_headers": HEADERS_MAX,
        },
    )
    app[HANDLERS], app[METRICS], app[SCHEDULER], app[PROBER] = handlers, metrics, scheduler, prober
    app[STREAMS] = set()
    status = StatusHandlers(
        fleet, metrics, client, [(b.label, b.base_url) for b in settings.backends]
    )
    app.router.add_get("/healthz", status.healthz)
    app.router.add_get("/readyz", status.readyz)
    app.router.add_get("/metrics", status.metrics)
    for path in HEALTH:
        app.router.add_get(path, status.health)
    for method, path in REFUSED:
        app.router.add_route(method, path, status.refused)
    admin = AdminHandlers(settings, fleet, clock, disk, churn)
    app.router.add_get("/admin/slots", admin.slots)
    app.router.add_get("/admin/disk", admin.disk)
    app.router.add_get("/admin/churn", admin.churn)
    for path, route in ROUTES.items():
        for method in route.methods:  # (a GET route answers HEAD too, as llama-server's do)
            extra = ("HEAD",) if method == "GET" and "HEAD" not in route.methods else ()
            for each in (method, *extra):
                app.router.add_route(each, path, handlers.forward)
    for method in ("GET", "HEAD"):  # any other path: the server's web UI, static files, 404s
        app.router.add_route(method, "/{path:.*}", handlers.other)

    async def upstream_ctx(app: web.Application) -> AsyncIterator[None]:
        await client.open()
        try:
            await prober.probe_all()
            await disk.refresh_layouts()
            await disk.index.reconcile(disk.directories())
            tasks = [asyncio.create_task(prober.run())] if probe_loop else []
            if settings.disk.reconcile_seconds > 0:
                every = settings.disk.reconcile_seconds
                tasks.append(asyncio.create_task(disk.index.maintain(disk.directories(), every)))
            if shared.enabled:
                await shared.refresh()
                await shared.heartbeat()  # (a replica never listed pins nothing in an outage)
                tasks.append(asyncio.create_task(shared.maintain(scheduler.wake)))
            yield
            shared.stopped = True
            for task in tasks:
                task.cancel()
            if tasks:  # bounded: a task whose cancellation a client library swallowed
                await asyncio.wait(tasks, timeout=STOP_SECONDS)  # ends after its round
            await reuse.close()
            await prober.close()
            with contextlib.suppress(TimeoutError):  # a hung store must not hang shutdown
                await asyncio.wait_for(shared.leave(), timeout=STOP_SECONDS)
            await store.close()
            offload.close()
        finally:
            await client.close()

    async def answer_waiters(app: web.Application) -> None:  # before handlers are cancelled
        scheduler.close()
        streams = app[STREAMS]
        for stream in list(streams):  # (each ends with an error event, not a cut body)
            stream.stop()

    app.on_shutdown.append(answer_waiters)
    app.on_response_prepare.append(_server_header)
    app.cleanup_ctx.append(upstream_ctx)
    return app


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_SOFTWARE  # (aiohttp's default names its own version)


def _middlewares(
    settings: Settings,
    metrics: ProxyMetrics,
    clock: Callable[[], float],
    preflight: Handler,
    cors: CorsMirror,
) -> list[Middleware]:
    """Request records, logging and errors (the proxy's own answers with ``cors``' headers);
    CORS preflights (any path) to a backend; then the API key check, when keys are set."""
    keys = settings.client_keys()
    own = frozenset({"/healthz", "/readyz"})
    checks = [make_key_check(keys, PUBLIC | own)] if keys else []
    return [make_middleware(metrics, clock, cors), make_preflight(preflight), *checks]


def _backend_counter(
    client: LlamaServerClient, settings: Settings, fleet: Fleet
) -> Callable[[str], Awaitable[int | None]]:
    """Count with the first ready backend's tokenizer (all backends serve one model), never a
    sleeping one's (``/tokenize`` would wake it and wait out its model load); None when every
    ready backend sleeps (the caller counts with tiktoken)."""

    async def count(text: str) -> int | None:
        for backend in fleet.backends:
            if backend.phase is BackendPhase.READY and not backend.asleep:
                return await client.count_tokens(settings.backends[backend.index].base_url, text)
        return None

    return count

"""Route handlers: a recipe per request, no policy.

parse (``core.request.body``) -> place (``scheduler`` over ``core.server.fleet``) -> forward
and relay (``upstream``, ``streaming``) -> record (fleet, metrics, the request's log record).
A connect failure before any byte was sent marks that backend down and retries once on
another backend; every other failure is reported, and an unfinished request's slot drains.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from aiohttp import web

from proxy.backends.health import Prober
from proxy.backends.scheduler import Scheduler
from proxy.config.settings import Settings
from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.prompt.headers import upstream_request_headers
from proxy.core.prompt.isolation import may_reuse
from proxy.core.request.body import ParsedBody, decode_json, pin_body
from proxy.core.server.fleet import BackendPhase, Placement
from proxy.core.server.placement import Need, avoiding, pick_backend, place
from proxy.disk.tier import DiskTier
from proxy.errors import BadGateway, GatewayTimeout, InvalidRequest, ProxyError
from proxy.http.forwarding import Forwarder
from proxy.http.intake import parse_for, read_body
from proxy.http.middleware import RECORD
from proxy.http.streaming import Outcome, relay, to_the_end
from proxy.metrics import ProxyMetrics
from proxy.offload import Offload
from proxy.replicas.shared_state import SharedState
from proxy.routing.router import Plan, Router
from proxy.upstream import (
    ROUTES,
    BackendLoading,
    LlamaServerClient,
    Route,
    SlotActionFailed,
    SlotUse,
    UpstreamConnectError,
)

log = logging.getLogger(__name__)


class ProxyHandlers:
    def __init__(
        self,
        settings: Settings,
        scheduler: Scheduler,
        router: Router,
        shared: SharedState,
        metrics: ProxyMetrics,
        clock: Callable[[], float],
        disk: DiskTier,
        forwarder: Forwarder,
        offload: Offload,
        client: LlamaServerClient,
        prober: Prober,
    ) -> None:
        self._settings = settings
        self._offload = offload  # large bodies: parsed and encoded in worker threads
        self._forwarder = forwarder
        self._disk = disk
        self._scheduler = scheduler
        self._router = router
        self._shared = shared
        self._fleet = scheduler.fleet
        self._metrics = metrics
        self._clock = clock
        self._client = client
        self._prober = prober

    # -- proxied endpoints ---------------------------------------------------------------
    async def preflight(self, request: web.Request) -> web.StreamResponse:
        """A CORS preflight (``OPTIONS``, any path): answered by a backend, whose
        ``--cors-*`` settings decide, as llama-server answers it before any routing."""
        return await self._unpinned(request, None)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        route = ROUTES[request.path]
        post = request.method == "POST"
        raw = await read_body(request, self._settings) if post else None
        if route.slot_use is SlotUse.NONE:
            if raw is not None and route.json:  # (any JSON value: the server reads it)
                await self._offload.run(len(raw), partial(decode_json, raw))
            return await self._unpinned(request, raw)
        assert raw is not None
        size, routing = len(raw), self._settings.routing
        async with self._offload.admitted(size):  # (a few large bodies at once)
            parsed = await self._offload.run(size, partial(parse_for, route, raw))
            need = self._need(route, parsed)
            routed = routing.prefix_aware and not need.exclusive and need.slot is None
            plan = await self._router.plan(request, parsed.data, size) if routed else None
        return await self._pinned(request, raw, parsed, need, plan)

    def _need(self, route: Route, parsed: ParsedBody) -> Need:
        # several tasks would all get one id_slot, every one after the first pinning a busy
        # slot: the server picks their slots, on a backend the request has to itself
        if route.slot_use is SlotUse.EXCLUSIVE or parsed.completions > 1 or parsed.tasks > 1:
            return Need(exclusive=True)
        wanted = parsed.client_id_slot if self._settings.routing.honor_client_id_slot else None
        if wanted == -1:
            wanted = None  # the server's own default: any slot
        if wanted is not None:
            most = max((len(b.slots) for b in self._fleet.backends), default=0)
            if not 0 <= wanted < most:
                raise InvalidRequest(f"id_slot must be in 0..{most - 1}", param="id_slot")
        return Need(slot=wanted)

    async def _pinned(
        self, request: web.Request, raw: bytes, parsed: ParsedBody, need: Need, plan: Plan | None
    ) -> web.StreamResponse:
        record = request[RECORD]
        if plan is not None:
            target = partial(self._router.target, plan)
            forwarded = await self._forwarder.forward(request, raw, target)
            if forwarded is not None:  # (its backend's home replica scheduled it)
                return forwarded
            await self._router.prepare(plan, parsed.data, parsed.prefix_cache)
            record.route_s = self._clock() - record.started
        for attempt in (1, 2):
            asked = self._clock()
            placement = await self._leased(plan, need)
            waited = self._clock() - asked  # (a retry on another backend asks again)
            record.queue_s = (record.queue_s or 0.0) + waited
            self._metrics.slot_wait.labels(request.path).observe(waited)
            pin = placement.pin if self._settings.routing.pin_slots or plan is None else None
            try:
                await self._prepare(plan, placement, parsed)
                reuse = self._may_reuse(plan, placement, pin)
                work = partial(pin_body, parsed.data, pin, reuse, parsed.source)
                body = await self._offload.run(len(raw), work)
            except BaseException:
                # disk-tier work may have reached the slot: drain it, let the lease expire
                self._shared.abandon(placement)
                self._release(placement, None, plan)
                raise
            try:
                tasks = parsed.tasks * parsed.completions
                return await self._send(request, placement.backend, body, placement, plan, tasks)
            except UpstreamConnectError as exc:
                self._backend_failed(placement.backend, exc)
                await self._unsent(placement)
                if attempt == 2:
                    raise
                avoid = avoiding(self._fleet.backends, need.avoid, placement.backend)
                need = replace(need, avoid=avoid)
        raise AssertionError("unreachable")

    async def _prepare(self, plan: Plan | None, placement: Placement, parsed: ParsedBody) -> None:
        """Work on the slot before the request is sent: the disk tier's (park, restore, save)
        and the primer that makes the server park the slot's content and load the session
        from its RAM cache, which the disk tier sends in its order (a slot the primer did not
        reach is parked on disk as any)."""
        primer = partial(self._prime, placement, parsed) if placement.primed else None
        if plan is not None and plan.disk is not None and plan.decision is not None:
            d = plan.decision
            args = (plan.disk, plan.fp, d.restore, d.predicted, placement, parsed.data, plan.chat)
            await self._disk.before(*args, primer)  # (it sends the primer, in its order)
        elif primer is not None:
            await primer()

    async def _prime(self, placement: Placement, parsed: ParsedBody) -> bool:
        """Send a primed placement's primer; whether it was. A failure is logged and counted,
        the fleet's model put back (nothing parked, nothing loaded), and the request goes on,
        reusing less."""
        assert placement.pin is not None
        url = self._settings.backends[placement.backend].base_url
        try:
            await self._client.prime(url, placement.pin, parsed.data)
        except SlotActionFailed as exc:
            log.warning("primer to %s slot %d failed: %s", url, placement.pin, exc)
            self._metrics.ram_primers.labels("failed").inc()
            self._fleet.unprimed(placement)
            return False
        self._metrics.ram_primers.labels("sent").inc()
        return True

    def _may_reuse(self, plan: Plan | None, placement: Placement, pin: int | None) -> bool:
        """Cache isolation (``core.prompt.isolation``): reuse the slot's KV only when it cannot
        hold another tenant's tokens; the slot is this tenant's afterwards."""
        if self._settings.isolation.mode == "off":
            return True
        slots = self._fleet.backends[placement.backend].slots
        if plan is None or plan.tenant is None or pin is None or pin >= len(slots):
            return False  # the server picks slots (n > 1) or the client did: no reuse
        slot = slots[pin]
        reuse = may_reuse(slot.owner, slot.content, slot.n_tokens, plan.fp, plan.tenant)
        slot.owner = plan.tenant
        return reuse

    async def _leased(self, plan: Plan | None, need: Need) -> Placement:
        """A placement whose slot this replica holds the shared lease of."""
        while True:
            if plan is None:
                placement = await self._scheduler.acquire(lambda: place(self._fleet.backends, need))
            else:  # (backends another replica schedules: forwarded there)
                avoid = need.avoid | self._forwarder.foreign()
                decide = self._router.decider(plan, avoid)
                settle = self._router.decider(plan, avoid, wait=False)
                placement = await self._scheduler.acquire(decide, plan.fp, plan.wait_until, settle)
            try:
                theirs = await self._shared.take(placement)
            except BaseException:  # (the client left meanwhile: nothing was sent)
                await to_the_end(self._unsent(placement))
                raise
            if theirs is None:
                return placement
            # another replica's: marked so before the release wakes a waiter that would take it
            self._scheduler.release(placement, clean=True, sent=False, remote=theirs)

    async def _unsent(self, placement: Placement) -> None:
        """A placement given up before anything was sent: its lease first (no local take
        under it), then its slot, as it was."""
        await self._shared.give_back(placement)
        self._scheduler.release(placement, clean=True, sent=False)

    async def other(self, request: web.Request) -> web.StreamResponse:
        """A GET or HEAD of a path that is no endpoint of the proxy's: a ready backend's
        answer (llama-server's web UI, its static files under ``--path``, or its 404)."""
        return await self._unpinned(request, None)

    async def _unpinned(self, request: web.Request, body: bytes | None) -> web.StreamResponse:
        avoid: frozenset[int] = frozenset()
        for attempt in (1, 2):
            pick = partial(pick_backend, self._fleet.backends, avoid)
            index = await self._scheduler.backend(pick)
            try:
                return await self._send(request, index, body, None)
            except UpstreamConnectError as exc:
                self._backend_failed(index, exc)
                if attempt == 2:
                    raise
                avoid = avoiding(self._fleet.backends, avoid, index)
        raise AssertionError("unreachable")

    def _backend_failed(self, index: int, exc: UpstreamConnectError) -> None:
        """Nothing reached the backend: it refused the connection (down until a probe finds it
        up), or it is loading its model (held until a probe finds it ready)."""
        loading = isinstance(exc, BackendLoading)
        label = self._fleet.backends[index].label
        self._metrics.upstream_errors.labels(label, "loading" if loading else "connect").inc()
        self._scheduler.mark_down(index, BackendPhase.LOADING if loading else BackendPhase.DOWN)
        self._metrics.backend_ready.labels(label).set(0)  # (as /readyz says, not a probe later)

    async def _send(
        self,
        request: web.Request,
        index: int,
        body: bytes | None,
        placement: Placement | None,
        plan: Plan | None = None,
        tasks: int = 1,
    ) -> web.StreamResponse:
        """Send the request to backend ``index`` and relay the answer (``tasks``: the server
        tasks the body makes, whose final chunks all carry usage)."""
        backend = self._settings.backends[index]
        record = request[RECORD]
        record.backend, record.slot = backend.label, (placement.pin if placement else None)
        known = ROUTES.get(request.path)  # (a preflight may name any path)
        via = known.via if known is not None and request.method != "OPTIONS" else None
        outcome: Outcome | None = None
        released, finished = placement is None, [False]

        async def before_eof(done: Outcome) -> None:  # a stream ends once the slot is given back
            if placement is not None and not finished[0]:
                finished[0] = True
                await to_the_end(self._finish(plan, placement, done))

        try:
            async with self._client.send(
                backend.base_url,
                via or request.rel_url.raw_path_qs,  # (the query string too)
                method=request.method,
                body=body,
                headers=upstream_request_headers(request.headers.items()),
            ) as upstream:
                outcome = await relay(
                    request,
                    upstream,
                    self._route_headers(request, plan),
                    self._clock,
                    lambda done: self._record(index, done, request, plan),
                    before_eof,
                    anthropic=via is not None,
                    tasks=tasks,
                )
        except UpstreamConnectError:
            released = True  # nothing reached the backend; the caller retries and releases
            raise
        except (GatewayTimeout, BadGateway) as exc:
            self._upstream_error(backend.label, exc)
            raise
        finally:
            if not released and not finished[0] and (outcome is None or not outcome.complete):
                assert placement is not None
                released = True
                try:
                    self._shared.abandon(placement)  # still busy upstream: let it expire
                finally:
                    self._release(placement, outcome, plan)
        if outcome.failure is not None:  # (after the status line: the stream ends in an error)
            self._upstream_error(backend.label, outcome.failure)
        if not released and not finished[0]:
            assert placement is not None
            await to_the_end(self._finish(plan, placement, outcome))
        return outcome.response

    def _upstream_error(self, label: str, error: ProxyError) -> None:
        kind = "timeout" if isinstance(error, GatewayTimeout) else "failed"
        self._metrics.upstream_errors.labels(label, kind).inc()

    async def _finish(self, plan: Plan | None, placement: Placement, outcome: Outcome) -> None:
        """After a complete response: disk-tier work, free the slot, record what it holds."""
        try:
            if plan is not None and plan.disk is not None and outcome.response.status == 200:
                held = self._router.content_after(plan, outcome.reply)
                await self._disk.after(plan.disk, placement, outcome.usage, held)
        finally:
            try:
                await self._shared.give_back(placement)  # first: no local take under its lease
            finally:
                content = self._release(placement, outcome, plan)
        if plan is not None and content is not None:
            await self._router.record(plan, placement, content, outcome.usage)

    def _release(
        self, placement: Placement, outcome: Outcome | None, plan: Plan | None
    ) -> Fingerprint | None:
        """Free (or drain) the slots; returns what the pinned slot now holds, if known."""
        clean = outcome is not None and outcome.complete
        content, n_tokens = None, None
        if clean and outcome is not None and outcome.response.status == 200:
            if plan is not None:
                content = self._router.content_after(plan, outcome.reply)
                self._router.released(plan, content)
            if outcome.usage is not None:
                n_tokens = outcome.usage.kv_tokens
        self._scheduler.release(placement, clean=clean, content=content, n_tokens=n_tokens)
        if not clean:
            self._prober.drain(placement.backend)
        return content

    def _route_headers(self, request: web.Request, plan: Plan | None) -> dict[str, str]:
        planned = self._router.headers(plan) if plan is not None else {}
        replica = self._shared.token if self._shared.enabled else None  # (``core.replicas.homes``)
        return request[RECORD].route_headers(self._settings.routing, planned, replica)

    def _record(
        self, index: int, outcome: Outcome, request: web.Request, plan: Plan | None
    ) -> None:
        record = request[RECORD]
        first = outcome.first_byte_at
        ttft = None if first is None else first - record.started
        label = self._settings.backends[index].label
        warmed = plan.disk.warmed if plan is not None and plan.disk is not None else 0
        self._metrics.response(request.path, label, ttft, outcome.usage, warmed)
        record.counted(outcome.usage)

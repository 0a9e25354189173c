"""Prefix-aware routing, the shell around ``core.routing.decision``.

Per request: fingerprint the prompt (``core.prompt.fingerprint`` with cached token counts), read
its cache_key affinity from the state store, and hand the scheduler a ``decide`` closure
that runs the pure policy on the fleet as it is at that moment (so a queued request is
routed on fresh state). After the response: the slot now holds prompt + reply, the
affinity follows where the request went, and predicted vs actual reuse is counted.
State-store failures never fail a request (``SharedState`` degrades to local state).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from aiohttp import web

from proxy.backends.scheduler import Decide, Scheduler
from proxy.config.settings import Settings
from proxy.core.disk.scope import Scope
from proxy.core.prompt.fingerprint import (
    Fingerprint,
    Segment,
    chat_segments,
    fingerprint_segments,
    reply_segment,
)
from proxy.core.prompt.headers import cache_key
from proxy.core.prompt.isolation import salt, tenant_of
from proxy.core.prompt.raw_blocks import fingerprint_raw
from proxy.core.prompt.usage import Reply, Usage
from proxy.core.replicas.homes import target
from proxy.core.request.body import is_chat, raw_prompt, type_error
from proxy.core.routing.decision import Decision, KeyOutcome, Reason, route
from proxy.core.routing.index import FleetIndex
from proxy.core.routing.returns import SCAN, ReturnTracker
from proxy.core.routing.scoring import RamView
from proxy.core.routing.wakes import Awaiting
from proxy.core.server.fleet import Fleet, NoPlacement, Placement
from proxy.disk.plan import DiskPlan
from proxy.disk.tier import DiskTier
from proxy.metrics import ProxyMetrics
from proxy.offload import Offload
from proxy.replicas.shared_state import SharedState
from proxy.routing.churn_tracker import ChurnTracker
from proxy.routing.tokenizer import TokenCounter

log = logging.getLogger(__name__)
CLAIM_TTL = 300.0  # a claimed release stays marked until its replica has settled it


@dataclass
class Plan:
    fp: Fingerprint
    chat: bool
    key: str | None
    hint: tuple[int, int] | None
    wait_until: float
    decision: Decision | None = None
    waits: int = field(default=0)
    held: bool = False  # waited for a slot held for its session
    disk: DiskPlan | None = None
    tenant: str | None = None  # under cache isolation
    client: str | None = None  # whose disk write cap its saves count against
    release: tuple[int, tuple[int, ...]] | None = None  # its response's, for its session
    after: Fingerprint | None = None  # what the slot holds after the reply (content_after)
    views: dict[int, RamView] = field(default_factory=dict)  # route's memo while it waits
    segments: list[Segment] | None = None  # a chat prompt's
    reuses: bool = True  # False: the client's ``cache_prompt: false`` (nothing is reused)


class Router:
    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        shared: SharedState,
        counter: TokenCounter,
        metrics: ProxyMetrics,
        clock: Callable[[], float],
        offload: Offload,  # a large prompt is fingerprinted in a worker thread
        scheduler: Scheduler,  # its queue length, and a wake-up when a hold ends
        disk: DiskTier | None = None,
        churn: ChurnTracker | None = None,  # prefix-churn diagnostics
        # with ``tokenizer: backend``: counts a text with a ready backend's tokenizer
        backend_tokens: Callable[[str], Awaitable[int | None]] | None = None,
    ) -> None:
        self._settings = settings
        self._disk = disk
        self._fleet = fleet
        self._shared = shared
        self._counter, self._offload = counter, offload
        self._metrics, self._clock = metrics, clock
        self._index = FleetIndex()  # the fleet's slots grouped for routing, kept while unchanged
        self.params = replace(settings.routing.params(), prime=fleet.primes)
        self._labels = {b.label: b.index for b in fleet.backends}
        self._scheduler = scheduler
        self._churn, self._backend_tokens = churn, backend_tokens
        # how soon sessions come back, and so how long a slot they left is held for them
        routing = settings.routing  # a hold is a wait: one bound for both
        self.returns = ReturnTracker(routing.max_slot_wait_seconds, shared=shared.enabled)

    def tenant(self, request: web.Request) -> str | None:
        """The request's tenant under cache isolation (None when isolation is off)."""
        mode, header = self._settings.isolation.mode, self._settings.isolation.tenant_header
        return None if mode == "off" else tenant_of(request.headers, header)

    def fingerprint(
        self, body: dict[str, Any], segments: Sequence[Segment] | None, seed: int = 0
    ) -> Fingerprint:
        """``segments``: a chat body's, split once by the caller; None for a raw prompt."""
        if segments is not None:
            return fingerprint_segments(segments, self._counter.count, seed)
        block, counter = self._settings.routing.block_tokens, self._counter
        text = partial(counter.blocks, block_tokens=block)
        ids = partial(counter.id_blocks, block_tokens=block)
        try:
            return fingerprint_raw(raw_prompt(body), text, ids, block, seed)
        except OverflowError:  # 32-bit ids (llama-server silently wraps a wider one)
            raise type_error("prompt", "text or 32-bit token ids") from None

    async def plan(self, request: web.Request, body: dict[str, Any], size: int) -> Plan:
        """The request's fingerprint, session key and affinity (no side effects but reading
        the shared view): enough to tell where it would go (``target``); ``size``: its bytes."""
        chat = is_chat(body)
        segments = await self._offload.run(size, partial(chat_segments, body)) if chat else None
        if segments is not None and self._backend_tokens is not None:
            await self._counter.prepare([s.text for s in segments], self._backend_tokens)
        tenant = self.tenant(request)
        seed = salt(tenant, body.get("lora"))
        fp = await self._offload.run(size, partial(self.fingerprint, body, segments, seed))
        key = cache_key(self._settings.routing.cache_key_sources, body, request.headers)
        if key is not None and tenant is not None:
            key = f"{tenant}:{key}"
        hint = None
        await self._shared.refresh()
        if key is not None:
            ref = await self._shared.get_affinity(key)
            if ref is not None and ref[0] in self._labels:
                hint = (self._labels[ref[0]], ref[1])
        wait_until = self._clock() + self._settings.routing.max_slot_wait_seconds
        who = self._disk.client_id(request.headers, tenant) if self._disk else None
        reuses = body.get("cache_prompt") is not False
        return Plan(
            fp,
            chat,
            key,
            hint,
            wait_until,
            tenant=tenant,
            segments=segments,
            client=who,
            reuses=reuses,
        )

    def target(self, plan: Plan, remote: frozenset[int]) -> int | None:
        """The backend the request would be placed on, or wait for, now (disk offers aside;
        ``remote``: backends another replica schedules, which lose ties)."""
        return target(self._route(plan, self._clock(), remote=remote))

    def _route(
        self,
        plan: Plan,
        now: float,
        allow_wait: bool = True,
        avoid: frozenset[int] = frozenset(),
        disk: DiskPlan | None = None,
        remote: frozenset[int] = frozenset(),
    ) -> Decision | NoPlacement:
        hold = self.returns.hold(now)
        self._metrics.slot_hold.set(hold)
        backends = self._fleet.backends
        if any(b.exact or not b.ram for b in backends):  # where the odds weigh (scoring)
            odds = self.returns.odds(now, sum(len(b.slots) for b in backends))
            if odds is not self.params.returns:
                self.params = replace(self.params, returns=odds)
        # (a request that reuses nothing gains nothing from a primer)
        params = self.params if plan.reuses else replace(self.params, prime=False)
        return route(
            plan.fp,
            self._fleet.backends,
            params,
            now=now,
            affinity=plan.hint,
            allow_wait=allow_wait,
            avoid=avoid,
            disk=disk.offers if disk is not None else None,
            queued=self._scheduler.waiting(),
            hold=hold,
            views=plan.views,
            remote=remote,
            index=self._index,
        )

    async def prepare(self, plan: Plan, body: dict[str, Any], scope: Scope | None) -> None:
        """The request is routed here: count its arrival, plan its disk-tier work."""
        if plan.segments is not None and self._churn is not None:
            self._churn.observe(plan.key, plan.fp, body, plan.segments)
        await self._arrived(plan.fp)
        if self._disk is not None and self._settings.routing.pin_slots and plan.reuses:
            plan.disk = await self._disk.plan(plan.fp, body, scope, plan.tenant, plan.client)

    async def _arrived(self, fp: Fingerprint) -> None:
        """How soon this request's session came back (``core.routing.returns``): through the shared
        store when replicas share one, since its last response may have come from another."""
        returns = self.returns
        if not returns.shared or returns.max_hold <= 0:
            returns.arrived(fp, self._clock())
            return
        expired = returns.expired()
        claimed = await self._shared.releases.claimed(expired) if expired else set()
        returns.missed(len(expired) - len(claimed or ()))
        if not self._shared.up:
            returns.arrived(fp, self._clock())  # Redis down: this replica's own releases
            return
        found = await self._shared.releases.claim_release(fp.hashes[-SCAN:], CLAIM_TTL)
        if found is not None:
            returns.returned(found[1], found[0])

    def decider(self, plan: Plan, avoid: frozenset[int], wait: bool = True) -> Decide:
        """The request's decision on the fleet as it is when asked; ``wait`` False: one that
        does not wait by choice (the scheduler's ``settle``)."""

        def decide() -> Placement | NoPlacement | Awaiting:
            now = self._clock()
            allowed = wait and now < plan.wait_until
            decision = self._route(plan, now, allowed, avoid, plan.disk)
            if isinstance(decision, NoPlacement):
                return decision
            plan.decision = decision
            if decision.placement is None:
                plan.waits += 1
                if decision.until is not None:
                    self._held(plan)
                    return Awaiting(None, decision.until, decision.wait_for)
                if decision.hold_end is not None:  # (it decides again when that hold ends)
                    return Awaiting(decision.wakes, *decision.hold_end)
                if decision.wakes is not None:
                    return Awaiting(decision.wakes)
                return NoPlacement.BUSY  # (any release may change it)
            self.returns.placed(now)
            return decision.placement

        return decide

    def _held(self, plan: Plan) -> None:
        """A request waits for a held slot: count it (the scheduler asks it again when the
        hold ends)."""
        if not plan.held:
            plan.held = True
            self._metrics.slot_hold_waits.inc()

    def released(self, plan: Plan, content: Fingerprint) -> None:
        """A response ended: the slot now holds ``content`` until its session is back."""
        plan.release = self.returns.released(plan.fp, content, self._clock())

    def content_after(self, plan: Plan, reply: Reply | None) -> Fingerprint:
        """What the slot holds after a complete response: prompt, then the reply (counted once
        per response: the disk tier and the release both ask)."""
        if reply is None or not plan.chat:  # a raw prompt's reply, kept after it: sealed
            return replace(plan.fp, sealed=True) if reply and reply.content else plan.fp
        if plan.after is None:
            segment = reply_segment(reply.content, reply.tool_calls or None)
            plan.after = plan.fp.extend([segment], self._counter.count)
        return plan.after

    def _in_backend_tokens(self, plan: Plan, decision: Decision) -> int:
        """The prediction in the chosen backend's tokens (estimates x the learned ratio); none
        for a client's ``cache_prompt: false`` (the server computes the whole prompt)."""
        if not plan.reuses:
            return 0
        if decision.placement is None:
            return decision.predicted
        return self._fleet.backends[decision.placement.backend].from_estimate(decision.predicted)

    def headers(self, plan: Plan) -> dict[str, str]:
        decision = plan.decision
        if decision is None:
            return {}
        reason = Reason.WAIT.value + "+" + decision.reason.value if plan.waits else decision.reason
        predicted = str(self._in_backend_tokens(plan, decision))
        return {"X-Cache-Route": str(reason), "X-Cache-Predicted-Tokens": predicted}

    async def record(
        self, plan: Plan, placement: Placement, content: Fingerprint, usage: Usage | None
    ) -> None:
        if plan.release is not None and self.returns.shared:
            ttl = self.returns.max_hold
            await self._shared.releases.put_release(*plan.release, ttl)
        decision = plan.decision
        label = self._fleet.backends[placement.backend].label
        if decision is not None:
            self._count(plan, decision, label, usage)
        if usage is not None:
            self._fleet.backends[placement.backend].learn(plan.fp.total, usage)
        if placement.pin is None:
            return
        if plan.key is not None:
            ttl = self._settings.routing.affinity_ttl_seconds
            await self._shared.set_affinity(plan.key, (label, placement.pin), ttl)
        slots = self._fleet.backends[placement.backend].slots
        if placement.pin >= len(slots):
            return  # the backend came back with fewer slots meanwhile
        await self._shared.publish(
            placement.backend, placement.pin, content, slots[placement.pin].n_tokens
        )

    def _count(self, plan: Plan, decision: Decision, label: str, usage: Usage | None) -> None:
        m = self._metrics
        m.route_decisions.labels(decision.reason.value).inc()
        if plan.waits:  # (it waited for a slot first: its header says ``wait+<reason>``)
            m.route_decisions.labels(Reason.WAIT.value).inc()
        if decision.key_outcome is not None:
            m.cache_key.labels(decision.key_outcome).inc()
            if decision.key_outcome is KeyOutcome.BUSY:
                log.info("ignoring busy cache_key slot; routed by %s", decision.reason.value)
        predicted = self._in_backend_tokens(plan, decision)
        m.predicted_tokens.labels(label).inc(predicted)
        if usage is None or _filled_after(plan):
            return
        actual = usage.cached_tokens
        if actual >= 0.9 * predicted and actual <= predicted + max(16, predicted // 10):
            outcome = "accurate"
        else:
            outcome = "over" if actual < predicted else "under"
        m.route_predictions.labels(outcome).inc()


def _filled_after(plan: Plan) -> bool:
    """Whether the disk tier filled the slot after the decision (``DiskPlan.filled``): the
    decision predicted the slot as it was, and what the request then reused is no measure of
    that (not counted in ``route_predictions``)."""
    return plan.disk is not None and plan.disk.filled

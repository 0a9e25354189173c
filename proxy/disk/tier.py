"""The disk tier: KV snapshots of stable prefixes through llama-server's slot save/restore.

Per routed request whose scope is not ``off`` (``--disk-prefix-cache``, narrowed by the
request's ``prefix_cache``: ``core.disk.scope.narrowed``):

1. ``plan`` (before routing): read the window of recent requests of the model and look up
   snapshots of every prefix of the request; routing weighs them (``core.routing.scoring``).
2. ``before`` (the slot is ours, nothing sent yet), in order:
   - *park before evict*: if the slot holds another conversation's long, recently used
     content that this request will overwrite and no snapshot of it exists, save it first;
   - *restore* the snapshot routing chose into the slot (a failure wipes the slot: it is
     then marked empty, the entry forgotten if its file is gone, else marked bad);
   - *scoped save* (``auto:N``/``N``, chat requests): select the prefix
     (``core.disk.scope``), check its boundary is safe (the rendering of the first k
     messages is a true prefix of the full rendering, and so are its tokens), prefill exactly
     that prefix into the slot (``/completion`` with the prefix tokens and ``n_predict: 0``),
     save the slot, then let the real request reuse it: every prompt token is computed once.
3. ``after`` (the response is complete, the slot still ours): check a restore was reused
   (else the snapshot is marked bad), save the whole slot for ``full``, learn the backend's
   prefill speed.

Snapshots live in the state store's index (``SnapshotIndex``); a backend's layout comes
from its ``/props`` (read again whenever the fleet sees it restart). Left out: a backend
without ``--slot-save-path`` (501) until it restarts, and one that cannot reuse a restored
slot (checkpoint-only, ``reuse_probe``) or whose rule is not probed yet. The disk tier
never fails a request: every step that goes wrong is logged and counted, and the request
goes on as if the disk were empty. A client over its write cap (``core.disk.quota``) is
served without the save.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from proxy.backends.health import flag_warnings
from proxy.config.settings import Settings
from proxy.core.disk.quota import WriteQuota
from proxy.core.disk.scope import Scope, ScopeMode, narrowed, parse_scope, select_prefix
from proxy.core.disk.snapshots import (
    BackendDisk,
    Layout,
    Lookup,
    Offer,
    offers,
    restore_failed,
    touched,
)
from proxy.core.prompt.fingerprint import Fingerprint, continues
from proxy.core.prompt.isolation import ANONYMOUS, KEEP, tenant_of
from proxy.core.prompt.usage import Usage
from proxy.core.request.body import is_chat
from proxy.core.server.fleet import BackendPhase, Fleet, Placement
from proxy.core.server.slots import measured
from proxy.disk.index import SnapshotIndex
from proxy.disk.plan import BackendDiskState, DiskPlan
from proxy.disk.steps import DiskSteps
from proxy.disk.windows import RecentWindows
from proxy.metrics import ProxyMetrics
from proxy.replicas.shared_state import SharedState
from proxy.upstream import LlamaServerClient, SlotActionFailed

log = logging.getLogger(__name__)


class DiskTier:
    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        shared: SharedState,
        metrics: ProxyMetrics,
        wall: Callable[[], float],
        clock: Callable[[], float],
        client: LlamaServerClient,
    ) -> None:
        self.settings = self._settings = settings
        self._disk = settings.disk
        self.default = parse_scope(settings.disk.prefix_cache)
        self.fleet = self._fleet = fleet
        self._shared = shared
        self._metrics = metrics
        self._wall = wall
        self._clock = clock
        self.backends = [BackendDiskState() for _ in settings.backends]
        self.index = SnapshotIndex(shared, metrics, settings.disk.max_bytes, self.path, wall)
        self.quota = WriteQuota(settings.disk.client_max_bytes, settings.disk.client_window_seconds)
        self.windows = RecentWindows(shared, wall, clock)
        self.parking: list[tuple[Fingerprint, asyncio.Future[None]]] = []  # parks in flight
        self.client = client
        self.steps = DiskSteps(client, self, metrics)
        metrics.disk_policy.labels(str(self.default)).set(1)

    def now(self) -> float:
        return self._clock()

    def wall(self) -> float:
        return self._wall()

    # -- where files live --------------------------------------------------------------------
    def directory(self, index: int) -> str:
        backend = self._settings.backends[index]
        path = backend.slot_save_dir or self._disk.slot_save_dir
        return f"dir:{Path(path).resolve()}" if path else f"backend:{backend.label}"

    def client_id(self, headers: Mapping[str, str], tenant: str | None) -> str | None:
        """A request's identity for the write cap (its tenant; None while there is no cap)."""
        if tenant is not None or self._disk.client_max_bytes <= 0:
            return tenant
        return tenant_of(headers, self._settings.isolation.tenant_header)

    def directories(self) -> list[str]:
        return sorted({self.directory(i) for i in range(len(self.backends))})

    def path(self, directory: str) -> Path | None:
        return Path(directory[4:]) if directory.startswith("dir:") else None

    # -- layouts ------------------------------------------------------------------------------
    async def refresh_layouts(self) -> None:
        """Read ``/props`` of every ready backend whose layout is unknown or stale (of an
        earlier epoch: it restarted since; a read that failed is tried again)."""
        for backend in self._fleet.backends:
            state = self.backends[backend.index]
            if backend.phase is not BackendPhase.READY or state.epoch == backend.epoch:
                continue
            epoch, state.supported, state.layout = backend.epoch, True, None
            try:
                props = await self.client.props(self._settings.backends[backend.index].base_url)
            except SlotActionFailed as exc:
                log.warning("[disk-cache] no layout for %s: %s", backend.label, exc)
                continue
            unified = self._settings.backends[backend.index].kv_unified
            state.layout, state.epoch = Layout.from_props(props, unified), epoch
            for warning in flag_warnings(props):
                log.warning("backend %s: %s", backend.label, warning)

    def _usable(self) -> list[BackendDisk]:
        return [
            BackendDisk(i, self.directory(i), s.layout, b.prefill_tps, s.restore_bps)
            for (i, s), b in zip(enumerate(self.backends), self._fleet.backends, strict=True)
            if self._layout(i) is not None
        ]

    def _layout(self, index: int) -> Layout | None:
        """Its layout while its snapshots are reusable (not checkpoint-only: ``reuse_probe``),
        read since it last restarted (one seen between a request's plan and its disk work
        may run another model)."""
        b, s = self._fleet.backends[index], self.backends[index]
        current = s.epoch == b.epoch and s.supported and b.reuse_known and not b.exact
        return s.layout if current else None

    # -- 1. before routing ----------------------------------------------------------------------
    async def plan(
        self,
        fp: Fingerprint,
        body: dict[str, Any],
        override: Scope | None,
        tenant: str | None = None,
        client: str | None = None,
    ) -> DiskPlan | None:
        scope = narrowed(self.default, override)
        if scope.mode is ScopeMode.OFF or not fp.hashes:
            return None
        await self.refresh_layouts()
        # a prompt under min_tokens: no snapshot is a prefix of it, none is cut from it (it
        # may still evict a session worth parking: the plan stays)
        small = fp.total < self._disk.min_tokens
        if not small:
            await self._after_parks(fp)
        lookup = Lookup({}, 0) if small else await self.lookup(fp, tenant)
        if lookup.refused:
            self._metrics.disk_refusals.labels("layout").inc(lookup.refused)
            self._metrics.disk_events.labels("refusal").inc(lookup.refused)
        model = str(body.get("model") or "default")[:128]
        if tenant is not None:
            model = f"{model}|{tenant}"  # each tenant's own window
        model = self.windows.key(model)  # (at most ``windows.MODELS`` of them)
        window: list[Fingerprint] = []
        if scope.mode is ScopeMode.AUTO and is_chat(body) and not small:  # (raw: no boundaries)
            window = await self.windows.read(model)
        dp = DiskPlan(scope, model, fp, lookup, window, lookup.found, tenant=tenant)
        dp.client = client or ANONYMOUS
        return dp

    async def lookup(self, fp: Fingerprint, tenant: str | None = None) -> Lookup:
        """The indexed snapshots of the request's prefixes, and each backend's best one (of a
        tenant's request under cache isolation, one it keeps ``KEEP`` of at least: a file it
        keeps less of would make the server consult its RAM cache)."""
        usable = self._usable()
        models = sorted({b.layout.model_id for b in usable if b.layout is not None})
        # no snapshot holds more than a slot's context; twice it leaves room for estimates
        most = max((2 * b.layout.n_ctx for b in usable if b.layout and b.layout.n_ctx), default=0)
        found = await self.index.find(fp, models, 1, most or None)
        return offers(fp, found, usable, KEEP if tenant is not None else 0.0)

    async def _after_parks(self, fp: Fingerprint) -> None:
        """A park of this request's conversation in flight (another request took its slot as
        its last turn ended, and saves what it held): wait for it, bounded, so the lookup finds
        the snapshot. The session's next turn arrives as the park starts — both follow its
        release — and would miss it (a yield before the lookup alone catches only the parks
        that have just finished: bench/HISTORY.md)."""
        waiting = [done for content, done in self.parking if continues(fp, content)]
        if waiting:
            await asyncio.wait(waiting, timeout=self._settings.routing.max_slot_wait_seconds)

    # -- 2. the slot is ours, nothing sent yet -------------------------------------------------
    async def before(
        self,
        dp: DiskPlan,
        fp: Fingerprint,
        restore: Offer | None,
        predicted: int,
        placement: Placement,
        body: dict[str, Any],
        chat: bool,
        primer: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        """``primer``: a primed placement's, sent here, before the rest: it replaces the slot's
        content, so ``park: on`` parks first; a primer that failed leaves the slot to be parked
        as for any request."""
        assert placement.pin is not None
        index, slot_id = placement.backend, placement.pin
        layout, primed, first = self._layout(index), False, False
        if primer is not None:
            first = layout is not None and self._disk.park == "on"
            if first:
                assert layout is not None
                await self.steps.park(dp, fp, index, slot_id, layout)
            primed = await primer()
        if layout is not None:
            await self.steps.park(dp, fp, index, slot_id, layout, primed or first)
            if restore is not None:
                await self.steps.restore(dp, restore, index, slot_id)
                predicted = (dp.restored_tokens and restore.reuse) or predicted
            small = fp.total < self._disk.min_tokens
            if chat and not small and dp.scope.mode in (ScopeMode.AUTO, ScopeMode.FIXED):
                choice = select_prefix(dp.scope, fp, dp.window, self._disk.min_tokens)
                seen = min(len(dp.window), dp.scope.window)
                seen = seen if dp.scope.mode is ScopeMode.AUTO else 0
                log.info(
                    "[disk-cache] %s scope: window=%d candidates=%d selected=%d tokens",
                    dp.scope.mode.value,
                    seen,
                    choice.candidates,
                    choice.tokens,
                )
                # (not into a primed slot: the warm-up would load the session the primer is
                # for, then cut it to the prefix)
                if choice.segments and predicted <= choice.tokens and not primed:
                    args = (dp, fp, choice.segments, index, slot_id, body, layout)
                    save = partial(self.steps.scoped_save, *args)
                    await self.steps.save_once(dp, choice.segments, index, slot_id, save)
        if not dp.offers and predicted < self._settings.routing.min_prefix_tokens:
            self._metrics.disk_events.labels("miss").inc()
        if not chat or fp.total < self._disk.min_tokens:
            return  # only chat requests are scoped, and of those only prompts a scope fits
        await self.windows.push(dp.model, fp)

    # -- 3. after the response ------------------------------------------------------------------
    async def after(
        self, dp: DiskPlan, placement: Placement, usage: Usage | None, content: Fingerprint
    ) -> None:
        assert placement.pin is not None
        layout = self._layout(placement.backend)
        if usage is not None:
            await self.judge_restore(dp, usage.cached_tokens, usage.prompt_tokens)
        if dp.scope.mode is ScopeMode.FULL and layout is not None:
            at = (placement.backend, placement.pin, layout)
            await self.steps.save_slot(dp, content, len(content.hashes), *at, "full")

    async def judge_restore(self, dp: DiskPlan, cached: int, prompt: int) -> None:
        """The first request after a restore tells whether the file was what it should be."""
        restored, dp.restored = dp.restored, None
        if restored is None:
            return
        if restore_failed(dp.restored_tokens, cached, prompt):
            log.warning(
                "[disk-cache] %s should have served %d tokens but the request reused %d: bad",
                restored.name,
                dp.restored_tokens,
                cached,
            )
            self._metrics.disk_events.labels("bad").inc()
            await self.index.update(replace(restored, bad=True))
        else:
            self._metrics.disk_events.labels("hit").inc()
            await self.index.update(touched(restored, self._wall()))

    def learn_restore(self, index: int, nbytes: int, ms: float) -> None:
        if ms > 0 and nbytes > 0:
            state = self.backends[index]
            state.restore_bps = measured(state.restore_bps, nbytes / (ms / 1000))

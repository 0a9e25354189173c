"""Each backend's reuse rule, probed in the background (the rule: ``core.server.reuse_rules``).

A backend configured ``kv_reuse: auto`` is probed once each time it becomes ready (at
start-up and after every restart: the model may have changed). ``schedule`` starts the
probe as a task, so no request waits for it: requests routed before its answer use the rule
the backend had (``prefix`` at first, the server's default for dense models). The disk
tier stays off on the backend until the answer (``BackendState.reuse_known``): a
checkpoint-only backend cannot reuse a restored slot, so every save would be wasted.

The probe never holds a slot a request could use: it claims one only while no request
waits in the proxy and another slot of the backend stays idle (a backend of one slot is not
probed: set ``kv_reuse``), checking again every ``RETRY_SECONDS``. It claims the slot through
the scheduler like any request (never a busy slot; with shared state it takes the slot's
lease like one), preferring an empty slot, then the least recently used.
It sends the two prompts of ``core.server.reuse_rules`` (``n_predict: 0``, tokens from the
backend's own tokenizer) and releases the slot holding nothing the proxy models (the
content it replaced is parked in the RAM model as for any request). A failed call drains
the slot like an aborted request and leaves the rule as it was.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from proxy.backends.scheduler import Scheduler
from proxy.config.settings import Settings
from proxy.core.server import reuse_rules
from proxy.core.server.fleet import BackendPhase, NoPlacement, Placement
from proxy.core.server.reuse_rules import Rule
from proxy.errors import ServiceUnavailable
from proxy.replicas.shared_state import SharedState
from proxy.upstream import LlamaServerClient, SlotActionFailed

log = logging.getLogger(__name__)
RETRY_SECONDS = 1.0  # until a slot is spare (or after the queue refused the probe)


class ReuseProber:
    def __init__(
        self,
        settings: Settings,
        scheduler: Scheduler,
        client: LlamaServerClient,
        drain: Callable[[int], None],
        shared: SharedState,
    ) -> None:
        self._settings = settings
        self._shared = shared
        self._scheduler = scheduler
        self._fleet = scheduler.fleet
        self._client = client
        self._drain = drain
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._warned: set[int] = set()  # backends told once why their disk tier is off

    def schedule(self, index: int) -> None:
        """The backend became ready (again): probe it, unless its rule is configured."""
        if self._settings.backends[index].kv_reuse != "auto":
            return
        backend = self._fleet.backends[index]
        backend.reuse_known = False
        running = self._tasks.get(index)
        if running is not None and not running.done():
            running.cancel()
        self._tasks[index] = asyncio.create_task(self._run(index, backend.epoch))

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _run(self, index: int, epoch: int) -> None:
        backend = self._fleet.backends[index]
        try:
            rule = await self._probe(index)
        except SlotActionFailed as exc:
            log.warning(
                "backend=%s reuse probe failed (%s): kept %s",
                backend.label,
                exc,
                _of(backend.exact),
            )
            rule = None
        if backend.epoch != epoch:
            return  # it restarted meanwhile: that start's probe answers
        backend.reuse_known = True
        if rule is None:
            return
        backend.exact = rule is Rule.EXACT
        log.info("backend=%s reuses KV by the %s rule (probed)", backend.label, rule.value)
        if backend.exact and index not in self._warned:
            self._warned.add(index)
            log.warning(
                "backend=%s reuses KV only at checkpoints or as an exact extension (a "
                "sliding-window model without --swa-full, or a hybrid or recurrent one): a "
                "slot restored from disk would not be reused, so the disk tier saves and "
                "restores nothing there; start it with --swa-full (SWA models) to use it",
                backend.label,
            )

    async def _probe(self, index: int) -> Rule | None:
        url = self._settings.backends[index].base_url
        props = await self._client.props(url)
        n_ctx = int((props.get("default_generation_settings") or {}).get("n_ctx", 0) or 0)
        sizes = reuse_rules.plan(n_ctx)
        if sizes is None:
            return None
        length, shared = sizes
        first = (await self._client.tokenize(url, _words("a", length)))[:length]
        other = await self._client.tokenize(url, _words("b", length))
        second = reuse_rules.diverging(first, other[1:], shared)
        if second is None:
            return None
        placement = await self._claim(index)
        done = False
        try:
            await self._client.warm(url, first, placement.pin or 0)
            answer = await self._client.warm(url, second, placement.pin or 0)
            done = True
        finally:
            if done:
                await self._shared.give_back(placement)  # the lease first, then the slot
            else:
                self._shared.abandon(placement)  # it may still run upstream: let it expire
            self._scheduler.release(placement, clean=done, n_tokens=len(second) if done else 0)
            if not done:
                self._drain(index)
        return reuse_rules.classify(shared, int(answer.get("timings", {}).get("cache_n", 0)))

    async def _claim(self, index: int) -> Placement:
        while True:
            if not self._spare(index):
                await asyncio.sleep(RETRY_SECONDS)
                continue
            try:
                placement = await self._scheduler.acquire(lambda: self._idle_slot(index))
            except ServiceUnavailable:
                await asyncio.sleep(RETRY_SECONDS)
                continue
            theirs = await self._shared.take(placement)
            if theirs is None:
                return placement
            self._scheduler.release(placement, clean=True, sent=False, remote=theirs)

    def _spare(self, index: int) -> bool:
        """Whether the backend has a slot to spare: no request waits in the proxy and, with
        the probe on one, another slot stays idle for the next request (a backend of one
        slot is never probed: its requests would wait behind two prefills)."""
        if self._scheduler.waiting():
            return False
        return len(self._fleet.backends[index].idle_slots()) >= 2

    def _idle_slot(self, index: int) -> Placement | NoPlacement:
        backend = self._fleet.backends[index]
        if backend.phase is not BackendPhase.READY:
            return NoPlacement.LOADING
        idle = sorted(backend.idle_slots(), key=lambda s: (s.content is not None, s.last_used))
        if not idle:
            return NoPlacement.BUSY
        return Placement(index, (idle[0].id,), idle[0].id)


def _words(stem: str, count: int) -> str:
    return " ".join(f"{stem}{i}" for i in range(count))


def _of(exact: bool) -> str:
    return (Rule.EXACT if exact else Rule.PREFIX).value

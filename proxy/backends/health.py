"""Background probing of backends and draining of aborted slots.

Every ``health.interval_seconds`` each backend is probed (``/health``, ``/props``, and
``/slots`` only while there is a reason, ``Fleet.wants_slots``: it keeps a backend awake) and the
result folded into the fleet (``Fleet.apply_probe``): readiness, restarts, slots busy with
traffic that is not ours. After a request is aborted its slot is DRAINING; ``drain`` polls
that backend's ``/slots`` until llama-server shows the slot idle, or gives up after
``drain_max_seconds`` and leaves the slot to the periodic probe.

How soon llama-server frees an aborted slot: a stream's task ends at its next token (the
write fails), but a request still waiting for its answer (not streamed, or before its first
token) is cancelled only when the server checks its connection, which it does after a whole
second in which no task result reached it (``HTTP_POLLING_SECONDS``: each result restarts
that second, and the answer to every ``/slots`` call is one). So the first drain poll comes
after ``drain_poll_seconds``, and from then on, while a slot of the backend drains, the
proxy's ``/slots`` calls to it (drain polls and periodic probes) are ``QUIET_SECONDS`` apart:
polling faster would keep the aborted task running until it ends by itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from proxy.backends.scheduler import Scheduler
from proxy.config.settings import HealthSettings, Settings
from proxy.core.server.fleet import BackendPhase, Probe, SlotPhase
from proxy.metrics import ProxyMetrics
from proxy.upstream import LlamaServerClient, Unread

log = logging.getLogger(__name__)
QUIET_SECONDS = 1.25  # between /slots calls to a draining backend: its 1 s check, and a margin


class Prober:
    def __init__(
        self,
        settings: Settings,
        client: LlamaServerClient,
        scheduler: Scheduler,
        metrics: ProxyMetrics,
        clock: Callable[[], float],
        on_restart: Callable[[int], Awaitable[None]] | None = None,
        on_ready: Callable[[int], None] | None = None,  # it came up or restarted
    ) -> None:
        self._backends = settings.backends
        self._on_restart = on_restart
        self._health: HealthSettings = settings.health
        self._client = client
        self._scheduler = scheduler
        self._fleet = scheduler.fleet
        self._metrics = metrics
        self._clock = clock
        self._drains: dict[int, asyncio.Task[None]] = {}
        self._asked: dict[int, float] = {}  # backend -> when its /slots was last called
        self._models: dict[int, str] = {}  # backend -> the model its info series names
        self._unread_why: dict[int, str] = {}  # backend -> why its last probe read nothing
        self.on_ready = on_ready

    async def probe_all(self) -> None:
        due = [i for i in range(len(self._backends)) if self._quiet_left(i) <= 0]
        await asyncio.gather(*(self.probe(i) for i in due))

    def _quiet_left(self, index: int) -> float:
        """While a slot of the backend drains: how long until a ``/slots`` call to it leaves
        the server its quiet second (module docstring); 0 when it may be called now."""
        asked = self._asked.get(index)
        if asked is None or not self._fleet.is_draining(index):
            return 0.0
        return max(0.0, asked + QUIET_SECONDS - self._clock())

    async def probe(self, index: int) -> Probe | None:
        started = self._asked[index] = self._clock()
        url, slots = self._backends[index].base_url, self._fleet.wants_slots(index)
        probe = await self._client.probe(url, slots)
        if isinstance(probe, Unread):  # (healthy, its slots not readable now: the next tells)
            self._unread(index, probe.reason)
            return None
        self._unread(index, None)
        if self.fold(index, probe, started) and self._on_restart is not None:
            await self._on_restart(index)
        return probe

    def _unread(self, index: int, reason: str | None) -> None:
        """Log why a healthy backend's probes tell nothing of its slots, once per reason (one
        never read stays not ready, which nothing else would explain), and when they do again."""
        before = self._unread_why.get(index)
        if reason == before:
            return
        label = self._fleet.backends[index].label
        if reason is not None:
            self._unread_why[index] = reason
            ready = self._fleet.backends[index].phase is BackendPhase.READY
            state = "its slot table kept as it was" if ready else "not ready until they can"
            log.warning("backend=%s healthy, its slots not read (%s): %s", label, reason, state)
        else:
            del self._unread_why[index]
            log.info("backend=%s slots read again", label)

    def fold(self, index: int, probe: Probe, started: float) -> bool:
        """Apply a probe; True when the backend's slot contents were invalidated."""
        backend = self._fleet.backends[index]
        before, idle = backend.phase, {s.id for s in backend.idle_slots()}
        invalidated = self._fleet.apply_probe(index, probe, started)
        if invalidated and probe.sleeping:
            log.info("backend=%s sleeping: its slot and RAM caches are gone", backend.label)
        elif invalidated and before is not BackendPhase.UNKNOWN and backend.epoch > 1:
            self._metrics.backend_restarts.labels(backend.label).inc()
            log.warning("backend=%s restarted: its slot state is invalidated", backend.label)
        elif before is BackendPhase.DOWN and backend.phase is BackendPhase.READY:
            log.info("backend=%s back, not restarted: its slot state kept", backend.label)
        if before is not backend.phase:
            log.info("backend=%s phase=%s", backend.label, backend.phase.value)
        self._export(index)
        up = invalidated and backend.phase is BackendPhase.READY and not probe.sleeping
        if up and self.on_ready is not None:  # it came up or restarted
            self.on_ready(index)
        freed = [(index, s.id) for s in backend.idle_slots() if s.id not in idle]
        if before is not backend.phase or invalidated:
            self._scheduler.wake()
        elif freed:  # slots another client (or an aborted request) left
            self._scheduler.wake(freed)
        return invalidated and before is not BackendPhase.UNKNOWN

    def _export(self, index: int) -> None:
        backend = self._fleet.backends[index]
        self._metrics.backend_ready.labels(backend.label).set(
            1 if backend.phase is BackendPhase.READY else 0
        )
        if backend.identity is not None:  # the model it runs: one series, the current one
            model = Path(backend.identity[0]).name[:128]
            model = model if model and backend.identity[0] != "None" else "unknown"
            before = self._models.get(index)
            if before != model:
                if before is not None:
                    self._metrics.backend_model.remove(backend.label, before)
                self._metrics.backend_model.labels(backend.label, model).set(1)
                self._models[index] = model
        for phase in SlotPhase:
            count = sum(1 for s in backend.slots if s.phase is phase)
            self._metrics.slots.labels(backend.label, phase.value).set(count)

    async def run(self) -> None:
        """A round every ``interval_seconds``, from its start: a round that waits for a backend
        that never answers (up to the probe timeout) does not stretch the others' period."""
        while True:
            started = self._clock()
            try:
                await self.probe_all()
            except Exception:  # (a round that fails must not end the probing for good)
                log.exception("probe round failed; the next one runs as usual")
            elapsed = self._clock() - started
            await asyncio.sleep(max(0.0, self._health.interval_seconds - elapsed))

    def drain_all(self, indexes: list[int], after: float = 0.0) -> None:
        for index in indexes:
            self.drain(index, after)

    def drain(self, index: int, after: float = 0.0) -> None:
        """Start (once per backend) polling until its DRAINING slots are idle, the first
        poll ``after`` seconds from now at the earliest."""
        task = self._drains.get(index)
        if task is None or task.done():
            self._drains[index] = asyncio.create_task(self._drain(index, after))

    async def _drain(self, index: int, after: float) -> None:
        if after > 0:
            await asyncio.sleep(after)
        deadline = self._clock() + self._health.drain_max_seconds
        pause = self._health.drain_poll_seconds  # the first: a stream's task ends at once
        blind = None  # every probe found its /slots unreadable: none will show the slot idle
        while self._fleet.is_draining(index) and self._clock() < deadline:
            await asyncio.sleep(pause)
            probe = await self.probe(index)
            if probe is not None and probe.phase is BackendPhase.READY and not probe.sleeping:
                blind = not probe.read and blind is not False
            pause = max(self._health.drain_poll_seconds, self._quiet_left(index))
        if not self._fleet.is_draining(index):
            return
        label = self._fleet.backends[index].label
        if blind:
            self._fleet.drained_unseen(index)
            log.warning("backend=%s slots unreadable: an aborted slot taken for idle", label)
            self._export(index)
            self._scheduler.wake()
            return
        self._fleet.recast(SlotPhase.DRAINING, SlotPhase.EXTERNAL, index)
        log.warning("backend=%s aborted slot still busy after drain limit", label)

    async def close(self) -> None:
        for task in self._drains.values():
            task.cancel()
        await asyncio.gather(*self._drains.values(), return_exceptions=True)


def flag_warnings(props: dict[str, Any]) -> list[str]:
    """What a backend's ``/props`` says against the recommended llama-server flags."""
    out = []
    if props.get("endpoint_slots") is False:
        out.append("started with --no-slots: busy and aborted slots cannot be seen")
    if props.get("endpoint_metrics") is False:
        out.append("started without --metrics: no server-side metrics to scrape")
    if props.get("is_sleeping"):
        out.append("sleeping (--sleep-idle-seconds): each sleep drops its KV and RAM caches")
    return out

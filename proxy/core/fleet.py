"""The proxy's view of every backend and slot, and where the next request may run.

State per backend: a phase (UNKNOWN until probed, READY, LOADING while llama-server loads
its model, DOWN when unreachable), an ``epoch`` that increases whenever the backend's slot
contents can no longer be trusted (it came back, restarted, or changed its slot count), and
its slots. Each slot is in one phase:

- IDLE: nothing of ours or anyone's runs on it; it may be pinned.
- BUSY: a request of ours runs on it.
- DRAINING: a request of ours was aborted; llama-server notices a closed connection only by
  polling (about 1 s), so the slot stays unpinnable until ``/slots`` shows it idle.
- EXTERNAL: ``/slots`` shows it processing but we sent nothing: someone else uses the server.
- REMOTE: another proxy replica holds its lease (shared state in Redis). When the store goes
  away that lease can no longer be seen to end: the slot drains like an aborted one.

The one safety rule, from llama-server's busy-slot pinning bug (a request pinned with
``id_slot`` to a slot that is generating can overwrite that slot's KV with another
conversation's): only an IDLE slot is ever placed. Every other phase blocks it.

Restart detection from probes: no boot id, so a restart is inferred when a backend returns to
READY from another phase, its slot count changes, or the highest ``id_task`` it reports goes
down (task ids grow for a process's life). ``now`` comes from the caller: no clock read here.

Each backend's RAM prompt cache is modelled (``core.ram_cache``) up to ``GHOST_LIMIT`` entries
or its token budget (the server bounds it only by memory: 64 entries forgot prefixes it held,
Mooncake synthetic 0.086 -> 0.110 hit rate at 256, the ideal); O(1) per entry unless the
prompt shares a quarter of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from proxy.core import ram_cache
from proxy.core.fingerprint import Fingerprint
from proxy.core.ram_cache import Parked

GHOST_LIMIT = 256


class BackendPhase(StrEnum):
    UNKNOWN = "unknown"
    READY = "ready"
    LOADING = "loading"
    DOWN = "down"


class SlotPhase(StrEnum):
    IDLE = "idle"
    BUSY = "busy"
    DRAINING = "draining"
    EXTERNAL = "external"
    REMOTE = "remote"


@dataclass(frozen=True)
class SlotProbe:
    id: int
    processing: bool
    n_tokens: int
    task_id: int


@dataclass(frozen=True)
class Probe:
    """What one round of ``/health`` + ``/props`` + ``/slots`` said about a backend."""

    phase: BackendPhase
    slots: tuple[SlotProbe, ...] = ()


@dataclass
class SlotState:
    id: int
    phase: SlotPhase = SlotPhase.IDLE
    last_used: float = 0.0
    n_tokens: int = 0  # real KV length, from responses and /slots
    content: Fingerprint | None = None  # what the KV holds, as a prompt fingerprint
    pending: Fingerprint | None = None  # the prompt in flight on it, while BUSY
    record_at: float = 0.0  # wall time of the shared record this content matches
    owner: str | None = None  # tenant whose request wrote the KV (cache isolation)

    @property
    def expected(self) -> Fingerprint | None:
        """What the KV will hold when the request in flight (if any) is done."""
        return self.pending if self.pending is not None else self.content


@dataclass
class BackendState:
    index: int
    label: str
    phase: BackendPhase = BackendPhase.UNKNOWN
    epoch: int = 0
    max_task_id: int = -1
    exact: bool = False  # reuse only as an exact extension (hybrid/recurrent/SWA models)
    ram: bool = True  # runs llama-server's host-RAM prompt cache (default --cache-ram)
    ram_tokens: int | None = None  # what that cache holds, in tokens (None: not bounded)
    prefill_tps: float = 1000.0  # prompt tokens computed per second (timings.prompt_ms, EMA)
    token_scale: float | None = None  # its tokens per fingerprint estimate (EMA)
    slots: list[SlotState] = field(default_factory=list)
    ghosts: list[Parked] = field(default_factory=list)  # oldest first; replaced, not mutated

    def idle_slots(self) -> list[SlotState]:
        return [s for s in self.slots if s.phase is SlotPhase.IDLE]

    def busy_count(self) -> int:
        return sum(1 for s in self.slots if s.phase is not SlotPhase.IDLE)

    def from_estimate(self, tokens: int) -> int:  # in this server's tokens (learned scale)
        return round(tokens * (self.token_scale or 1.0))

    def kv_tokens(self, content: Fingerprint, n_tokens: int = 0) -> int:
        return n_tokens if n_tokens > 0 else self.from_estimate(content.total)  # known, or est.

    def parked(self, content: Fingerprint, at: float, n_tokens: int = 0) -> Parked:
        return Parked(content, at, self.kv_tokens(content, n_tokens))


@dataclass(frozen=True)
class Placement:
    backend: int
    slots: tuple[int, ...]
    pin: int | None  # the id_slot to send; None when the server must choose
    loads: Parked | None = None  # the RAM-cache entry the server is predicted to load


class NoPlacement(StrEnum):
    BUSY = "busy"  # a READY backend exists; wait for a slot
    LOADING = "loading"  # none READY, some LOADING or not yet probed; wait for the model
    DOWN = "down"  # nothing is up: fail now


class Fleet:
    """Mutable table of backends and slots; every change is a method taking ``now``."""

    def __init__(
        self,
        labels: Sequence[str],
        exact: Sequence[bool] = (),
        ram: Sequence[bool] = (),
        ghost_limit: int = GHOST_LIMIT,
        ram_tokens: Sequence[int | None] = (),
    ) -> None:
        self.backends = [
            BackendState(
                i,
                label,
                exact=bool(exact[i]) if i < len(exact) else False,
                ram=bool(ram[i]) if i < len(ram) else True,
                ram_tokens=ram_tokens[i] if i < len(ram_tokens) else None,
            )
            for i, label in enumerate(labels)
        ]
        self._ghost_limit = ghost_limit

    def claim(self, placement: Placement, now: float, content: Fingerprint | None = None) -> None:
        """Mark the slots busy; the pinned slot will hold ``content`` (the prompt) after."""
        backend = self.backends[placement.backend]
        for slot_id in placement.slots:
            slot = backend.slots[slot_id]
            if slot.phase is not SlotPhase.IDLE:
                raise ValueError(f"slot {slot_id} of {backend.label} is {slot.phase.value}")
            slot.phase = SlotPhase.BUSY
            slot.pending = content if slot_id == placement.pin else None
            if backend.ram and slot_id == placement.pin and content is not None:
                # The server parks what the slot held in RAM as the task starts when the prompt
                # keeps less than half of it (else its hook does not run), and moves the entry
                # it loads into the slot: the evicted session finds its content there now.
                old, entry = slot.content, None
                if old is not None and ram_cache.hook_runs(old, content):
                    entry = backend.parked(old, slot.last_used, slot.n_tokens)
                self._park(backend, entry, content)
                backend.ghosts = ram_cache.without(backend.ghosts, placement.loads)
            slot.last_used = now
        if backend.ram:  # --cache-idle-slots: every task saves each idle slot's content
            for idle in backend.idle_slots():
                if idle.content is not None:
                    self._park(backend, backend.parked(idle.content, idle.last_used, idle.n_tokens))

    def release(
        self,
        placement: Placement,
        now: float,
        *,
        clean: bool,
        sent: bool = True,
        content: Fingerprint | None = None,
        n_tokens: int | None = None,
        remote: bool = False,
    ) -> None:
        """End a claim. ``sent=False``: the slot is as before (``remote``: the pinned one is
        another replica's, its lease refused; so marked before a waiter wakes). ``clean=False``
        (aborted upstream) drains and forgets the content. Otherwise the pinned slot holds
        ``content`` (prompt and reply) or, without it, the prompt that was in flight."""
        backend = self.backends[placement.backend]
        for slot_id in placement.slots:
            if slot_id >= len(backend.slots):
                continue  # the backend came back with fewer slots
            slot = backend.slots[slot_id]
            if slot.phase is not SlotPhase.BUSY:
                continue
            pending, slot.pending = slot.pending, None
            if not sent:
                theirs = remote and slot_id == placement.pin
                slot.phase = SlotPhase.REMOTE if theirs else SlotPhase.IDLE
                continue
            parked_at, slot.last_used = slot.last_used, now
            slot.phase = SlotPhase.IDLE if clean else SlotPhase.DRAINING
            if not clean or slot_id != placement.pin:
                slot.content = None
                continue
            before, slot.content = slot.content, content if content is not None else pending
            if backend.ram and pending is None:  # else parked when claimed
                entry = backend.parked(before, parked_at, slot.n_tokens) if before else None
                self._park(backend, entry, slot.content)
            slot.n_tokens = n_tokens or 0  # a length the response did not report is unknown

    def _park(
        self, backend: BackendState, before: Parked | None, after: Fingerprint | None = None
    ) -> None:
        limit, budget = self._ghost_limit, backend.ram_tokens
        backend.ghosts = ram_cache.park(backend.ghosts, before, after, limit, budget)

    def is_draining(self, index: int) -> bool:
        b = self.backends[index]
        return b.phase is BackendPhase.READY and any(s.phase is SlotPhase.DRAINING for s in b.slots)

    def recast(self, old: SlotPhase, new: SlotPhase, index: int | None = None) -> list[int]:
        """Every ``old`` slot (of backend ``index``, or of all) becomes ``new``; the backends that
        had one. A drain given up: EXTERNAL, someone else's until a probe shows it idle."""
        found = [(b.index, s) for b in self.backends for s in b.slots if s.phase is old]
        for _, slot in (f for f in found if index is None or f[0] == index):
            slot.phase = new
        return sorted({i for i, _ in found if index is None or i == index})

    def fold_shared(
        self,
        index: int,
        leased: set[int],
        records: dict[int, tuple[Fingerprint, int, float]],
        now: float,
        wall: float,
    ) -> None:
        """Fold other replicas' leases (a leased EXTERNAL slot is theirs; an ended lease: just
        used) and newer slot records in; a newer record dates the last use (both clocks, now)."""
        for slot in self.backends[index].slots:
            if slot.phase in (SlotPhase.IDLE, SlotPhase.EXTERNAL) and slot.id in leased:
                slot.phase = SlotPhase.REMOTE
            elif slot.phase is SlotPhase.REMOTE and slot.id not in leased:
                slot.phase, slot.last_used = SlotPhase.IDLE, max(slot.last_used, now)
            found = records.get(slot.id)
            if found is not None and found[2] > slot.record_at and slot.phase is not SlotPhase.BUSY:
                slot.content, slot.n_tokens, slot.record_at = found
                slot.last_used = max(slot.last_used, now - max(0.0, wall - found[2]))
                slot.owner = None  # written through another replica: tenant unknown

    def mark_down(self, index: int) -> None:
        self.apply_probe(index, Probe(BackendPhase.DOWN), now=0.0)

    def apply_probe(self, index: int, probe: Probe, now: float) -> bool:
        """Fold a probe in (``now``: when it was sent, so a release after it is not undone by
        it); returns True when the backend's slot contents were invalidated."""
        backend = self.backends[index]
        if probe.phase is not BackendPhase.READY:
            backend.phase = probe.phase
            return False
        restarted = backend.phase is not BackendPhase.READY or self._restarted(backend, probe)
        backend.phase = BackendPhase.READY
        if restarted:
            backend.epoch += 1
            backend.max_task_id = -1
            backend.ghosts = []
            self._reset_slots(backend, len(probe.slots))
        for seen in probe.slots:
            self._fold_slot(backend.slots[seen.id], seen, now)
            backend.max_task_id = max(backend.max_task_id, seen.task_id)
        return restarted

    @staticmethod
    def _restarted(backend: BackendState, probe: Probe) -> bool:
        if len(probe.slots) != len(backend.slots):
            return True
        highest = max((s.task_id for s in probe.slots), default=-1)
        return highest < backend.max_task_id

    @staticmethod
    def _reset_slots(backend: BackendState, count: int) -> None:
        kept = {s.id: s.phase for s in backend.slots if s.phase is SlotPhase.BUSY}
        backend.slots = [SlotState(i, kept.get(i, SlotPhase.IDLE)) for i in range(count)]

    @staticmethod
    def _fold_slot(slot: SlotState, seen: SlotProbe, started: float) -> None:
        if slot.phase in (SlotPhase.BUSY, SlotPhase.REMOTE):
            return  # ours, or another replica's: their requests end the claim
        if seen.processing:
            # A probe that started before our last release may still see our own request.
            if slot.phase is SlotPhase.IDLE and slot.last_used < started:
                slot.phase = SlotPhase.EXTERNAL
            return
        if slot.phase is SlotPhase.EXTERNAL:  # a request just left it (another replica's: its
            slot.last_used = max(slot.last_used, started)  # record, with the content, follows)
        slot.phase = SlotPhase.IDLE
        _reconcile(slot, seen.n_tokens)
        slot.n_tokens = seen.n_tokens


def _reconcile(slot: SlotState, seen_tokens: int) -> None:
    """Trim what we believe a slot holds to what ``/slots`` says its KV length is."""
    content = slot.content
    if content is None or seen_tokens >= slot.n_tokens:
        return
    if seen_tokens == 0 or slot.n_tokens == 0:
        slot.content = None
        return
    keep = content.total * seen_tokens / slot.n_tokens
    segments = sum(1 for t in content.tokens if t <= keep)
    slot.content = Fingerprint(content.hashes[:segments], content.tokens[:segments], content.anchor)

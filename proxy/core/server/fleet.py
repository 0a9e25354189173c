"""How the proxy's view of every backend and slot changes: claims, releases, probes,
other replicas' leases and records.

The state itself (backend and slot phases, the one safety rule) is in ``core.server.slots``.

Restart detection from probes: llama-server has no boot id, so a restart is inferred from
evidence: the backend was never READY or was LOADING (a start loads the model), its slot count
changed, what ``/props`` says it runs changed (model, context, build: ``Probe.identity``,
read on every probe, so a restart with another model between two probes of an idle backend
is seen), or the highest ``id_task`` its ``/slots`` reports went down (task ids grow for a
process's life, and a fresh server's slots report none). A backend that was DOWN (a probe
timed out, a connection failed) and comes back with none of that evidence kept its KV: its
slot contents, tenants and RAM cache stay known, and only a slot on which a task ran unseen
meanwhile (its ``id_task`` above every one seen before) is forgotten. Without that evidence
to read (``/slots`` disabled or locked, or no task id ever seen) a return counts as a restart.
A restarted server that ran more tasks than the old one had before its first read passes as
a return; then a slot's shorter KV trims its content as at any read. ``now`` comes from the
caller: no clock read here.

``/slots`` is a task to llama-server: reading it wakes a sleeping server and restarts its idle
timer (``--sleep-idle-seconds``), so a probe reads it only while there is a reason
(``wants_slots``): the backend is not known READY, we sent it work since the last read, or
a slot is not IDLE (ours, another replica's, draining, or busy with traffic not ours). An
idle backend is probed by ``/health`` and ``/props``, which carries ``is_sleeping``: going to
sleep destroys the server's context, so every slot's content and the RAM cache are forgotten.

Each backend's RAM prompt cache is modelled (``core.server.ram_cache``) up to ``RAM_ENTRY_LIMIT``
entries or its token budget (the server bounds it only by memory: a model of fewer entries forgets
prefixes the server still holds); O(1) per entry unless the prompt shares a quarter of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.core.prompt.fingerprint import Fingerprint, common_segments
from proxy.core.server import ram_cache
from proxy.core.server.ram_cache import RamEntry
from proxy.core.server.slots import (
    BackendPhase,
    BackendState,
    NoPlacement,
    Placement,
    Probe,
    SlotPhase,
    SlotProbe,
    SlotState,
    Undo,
)

__all__ = [
    "RAM_ENTRY_LIMIT",
    "BackendPhase",
    "BackendState",
    "Fleet",
    "NoPlacement",
    "Placement",
    "Probe",
    "SlotPhase",
    "SlotProbe",
    "SlotState",
]

RAM_ENTRY_LIMIT = 256


class Fleet:
    """Mutable table of backends and slots; every change is a method taking ``now``."""

    def __init__(
        self,
        labels: Sequence[str],
        exact: Sequence[bool] = (),
        ram: Sequence[bool] = (),
        ram_entry_limit: int = RAM_ENTRY_LIMIT,
        ram_tokens: Sequence[int | None] = (),
        idle_saves: Sequence[bool] = (),
        unified: Sequence[bool] = (),
        primes: bool = True,
    ) -> None:
        self.backends = [
            BackendState(
                i,
                label,
                exact=bool(exact[i]) if i < len(exact) else False,
                ram=bool(ram[i]) if i < len(ram) else True,
                ram_tokens=ram_tokens[i] if i < len(ram_tokens) else None,
                idle_saves=bool(idle_saves[i]) if i < len(idle_saves) else True,
                unified=bool(unified[i]) if i < len(unified) else False,
            )
            for i, label in enumerate(labels)
        ]
        self._ram_entry_limit = ram_entry_limit
        # the router may prime slots (``ram_cache.PRIMER``): not under cache isolation, nor
        # with slots not pinned
        self.primes = primes

    def full(self) -> bool:
        """Some backend is READY and none of those has an IDLE slot: nothing can be placed
        (only IDLE slots are), whatever a request would choose."""
        ready = [b for b in self.backends if b.phase is BackendPhase.READY]
        return bool(ready) and not any(b.idle_slots() for b in ready)

    def claim(self, placement: Placement, now: float, content: Fingerprint | None = None) -> None:
        """Mark the slots busy; the pinned slot will hold ``content`` (the prompt) after."""
        backend = self.backends[placement.backend]
        before, used = backend.ram_entries, {}
        for slot_id in placement.slots:
            slot = backend.slots[slot_id]
            if slot.phase is not SlotPhase.IDLE:
                raise ValueError(f"slot {slot_id} of {backend.label} is {slot.phase.value}")
            slot.phase = SlotPhase.BUSY
            slot.pending = content if slot_id == placement.pin else None
            if backend.ram and slot_id == placement.pin and content is not None:
                parked = _ram_entry_of(backend, slot, content, placement.primed)
                self._save_to_ram(backend, parked, content)  # (entries the slot now holds go)
                backend.ram_entries = ram_cache.without(backend.ram_entries, placement.from_ram)
            used[slot_id], slot.last_used = slot.last_used, now
        backend.unread = True
        backend.asleep = False  # a task wakes it: a probe that sees it asleep again is news
        self._save_idle(backend)
        backend.turns += 1
        for slot_id, last_used in used.items():
            undo = Undo(last_used, before, backend.ram_entries, backend.turns)
            backend.slots[slot_id].undo = undo

    def release(
        self,
        placement: Placement,
        now: float,
        *,
        clean: bool,
        sent: bool = True,
        content: Fingerprint | None = None,
        n_tokens: int | None = None,
        remote: int | None = None,
    ) -> None:
        """End a claim. ``sent=False``: the slot is as before (``remote``: a slot that is
        another replica's, its lease refused; so marked before a waiter wakes). ``clean=False``
        (aborted upstream) drains, the pinned slot holding as much of the prompt in flight as
        the drain's read shows. Otherwise the pinned slot holds ``content`` (prompt and reply)
        or, without it, the prompt that was in flight."""
        backend = self.backends[placement.backend]
        for slot_id in placement.slots:
            if slot_id >= len(backend.slots):
                continue  # the backend came back with fewer slots
            slot = backend.slots[slot_id]
            if slot.phase is not SlotPhase.BUSY:
                continue
            pending, slot.pending = slot.pending, None
            undo, slot.undo = slot.undo, None
            if not sent:
                slot.phase = SlotPhase.REMOTE if slot_id == remote else SlotPhase.IDLE
                slot.remote_since = now
                if undo is not None:
                    slot.last_used = undo.last_used
                    later = backend.turns != undo.turn or backend.ram_entries is not undo.ram_after
                    if not later:
                        backend.ram_entries = undo.ram_before
                continue
            parked_at, slot.last_used = slot.last_used, now
            slot.phase = SlotPhase.IDLE if clean else SlotPhase.DRAINING
            if slot_id != placement.pin:
                slot.content = None
                continue
            if not clean:
                # the server keeps what it computed of a task cut short: a prefix of the
                # prompt, which the drain's ``/slots`` read trims to the KV's length
                # (``_reconcile``; a length it counts in the server's tokens). A task cut
                # before it started left the KV as it was, whoever wrote it: its tenant is
                # unknown (``core.prompt.isolation``: no tenant reuses it)
                slot.content, slot.owner = pending, None
                slot.n_tokens = backend.kv_tokens(pending) if pending is not None else 0
                continue
            before, slot.content = slot.content, content if content is not None else pending
            if backend.ram and pending is None:  # else parked when claimed
                entry = backend.ram_entry(before, parked_at, slot.n_tokens) if before else None
                self._save_to_ram(backend, entry, slot.content)
            slot.n_tokens = n_tokens or 0  # a length the response did not report is unknown
        if sent:
            backend.turns += 1

    def unprimed(self, placement: Placement) -> None:
        """The primer of a primed claim failed: the server neither parked the slot's content
        nor will load the entry. The RAM-cache model is put back as before the claim, with
        its idle saves; or, when other tasks changed it since, the claim's park of the content
        is taken out (unless a copy was there before) and the entry put back where it was."""
        backend = self.backends[placement.backend]
        slot = backend.slots[placement.pin] if placement.pin is not None else None
        undo = slot.undo if slot is not None else None
        if slot is None or undo is None:
            return
        if backend.turns == undo.turn and backend.ram_entries is undo.ram_after:
            backend.ram_entries = undo.ram_before
            self._save_idle(backend)
        else:
            entries, old, loaded = list(backend.ram_entries), slot.content, placement.from_ram
            if old is not None and not ram_cache.held(undo.ram_before, old):
                entries = [e for e in entries if e.content is not old]
            if loaded is not None and loaded not in entries:
                before = undo.ram_before
                entries.insert(before.index(loaded) if loaded in before else 0, loaded)
            backend.ram_entries = entries
        slot.undo = undo._replace(ram_after=backend.ram_entries)

    def _save_idle(self, backend: BackendState) -> None:
        """A task started: with ``--cache-idle-slots`` the server saves each idle slot (and
        clears it too with unified KV, where its cells are room for the others)."""
        for idle in backend.idle_slots() if backend.ram and backend.idle_saves else ():
            if idle.content is not None and not _saved(idle, backend.ram_entries):
                self._save_to_ram(
                    backend, backend.ram_entry(idle.content, idle.last_used, idle.n_tokens)
                )
                # saving it again changes nothing while the cache is this same list
                idle.saved = (idle.content, backend.ram_entries)
            if backend.unified:
                idle.content, idle.n_tokens = None, 0

    def _save_to_ram(
        self, backend: BackendState, before: RamEntry | None, after: Fingerprint | None = None
    ) -> None:
        limit, budget = self._ram_entry_limit, backend.ram_tokens
        backend.ram_entries = ram_cache.park(backend.ram_entries, before, after, limit, budget)

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

    def drained_unseen(self, index: int) -> None:
        """A drain given up on a backend whose ``/slots`` cannot be read (``--no-slots``, or
        its API key not given to the proxy): no probe will ever show its slots idle, so they
        are taken for idle now (the server frees an aborted task at its next connection
        check, within a second; the drain waited longer), what they hold unknown."""
        for slot in self.backends[index].slots:
            if slot.phase is SlotPhase.DRAINING:
                slot.phase, slot.content, slot.n_tokens, slot.owner = SlotPhase.IDLE, None, 0, None

    def fold_shared(
        self,
        index: int,
        leased: set[int],
        records: dict[int, tuple[Fingerprint, int, float]],
        now: float,
        wall: float,
        lease_ttl: float = float("inf"),
    ) -> None:
        """Fold other replicas' leases (a leased EXTERNAL slot is theirs; an ended lease: just
        used) and newer slot records in; a newer record dates the last use (``wall``: the
        store's clock when it was read, which the records' stamps are in; ``now``: ours).
        A lease ends when its replica gives it back, its record following, or when it expires
        (``lease_ttl`` seconds after the last renewal): its replica died or gave the request
        up, and the request may still run on the server. So a lease that ended a TTL or more
        after it was first seen leaves the slot EXTERNAL, until a newer record (the request
        ended cleanly) or a ``/slots`` read shows it idle; one that ended sooner was given back.
        Their tasks change the backend's RAM cache as ours do (``claim``): a task they
        started saves every idle slot, and content their request replaced is parked when
        the server's hook ran (so a replica that forwards by its own view of a backend it
        does not schedule still finds the sessions parked there)."""
        backend = self.backends[index]
        started = False
        for slot in backend.slots:
            if slot.phase in (SlotPhase.IDLE, SlotPhase.EXTERNAL) and slot.id in leased:
                slot.phase, slot.remote_since, started = SlotPhase.REMOTE, now, True
            elif slot.phase is SlotPhase.REMOTE and slot.id not in leased:
                expired = now - slot.remote_since >= lease_ttl
                slot.phase = SlotPhase.EXTERNAL if expired else SlotPhase.IDLE
                slot.last_used = max(slot.last_used, now)
            found = records.get(slot.id)
            if found is None or found[2] <= slot.record_at:
                continue
            if slot.phase is SlotPhase.EXTERNAL and slot.id not in leased:
                slot.phase = SlotPhase.IDLE  # a replica's request ended there cleanly since
            if slot.phase is not SlotPhase.BUSY:
                primes = self.primes and backend.primable
                primed = primes and _loaded(backend, slot.content, found[0])
                parked = _ram_entry_of(backend, slot, found[0], primed) if backend.ram else None
                if parked is not None:
                    self._save_to_ram(backend, parked, found[0])
                if slot.content is None or slot.content.hashes != found[0].hashes:
                    slot.owner = None  # written through another replica: tenant unknown
                slot.content, slot.n_tokens, slot.record_at = found
                slot.last_used = max(slot.last_used, now - max(0.0, wall - found[2]))
        if started:
            backend.asleep = False  # another replica's task woke it
            self._save_idle(backend)

    def mark_down(self, index: int, phase: BackendPhase = BackendPhase.DOWN) -> None:
        self.apply_probe(index, Probe(phase), now=0.0)

    def apply_probe(self, index: int, probe: Probe, now: float) -> bool:
        """Fold a probe in (``now``: when it was sent, so a release after it is not undone by
        it); returns True when the backend's slot contents were invalidated."""
        backend = self.backends[index]
        if probe.phase is not BackendPhase.READY:
            backend.phase = probe.phase
            return False
        returned, seen_up_to = backend.phase is BackendPhase.DOWN, backend.max_task_id
        restarted = self._restarted(backend, probe, returned)
        back = returned and not restarted  # the same process, its KV kept
        backend.phase = BackendPhase.READY
        backend.identity = probe.identity or backend.identity
        if restarted:
            backend.epoch += 1
            backend.max_task_id = -1
            backend.ram_entries = []
            self._reset_slots(backend, len(probe.slots))
        slept, backend.asleep = probe.sleeping and not backend.asleep, probe.sleeping
        if slept:
            self._forget(backend)
        if not probe.read:
            if not (restarted or slept):
                _lapsed_unseen(backend, now)
            return restarted or slept
        for seen in probe.slots:
            slot = backend.slots[seen.id]
            if back and seen.task_id > seen_up_to and slot.phase is not SlotPhase.BUSY:
                slot.content, slot.owner = None, None  # written unseen while it was away
            self._fold_slot(slot, seen, now)
            backend.max_task_id = max(backend.max_task_id, seen.task_id)
        backend.unread = any(s.phase is SlotPhase.BUSY for s in backend.slots)
        return restarted

    def wants_slots(self, index: int) -> bool:
        """Whether the next probe of the backend should read ``/slots`` (see above)."""
        backend = self.backends[index]
        return backend.phase is not BackendPhase.READY or backend.unread or backend.busy_count() > 0

    @staticmethod
    def _forget(backend: BackendState) -> None:
        """It went to sleep: its KV and RAM cache are gone, and nothing runs on it."""
        backend.ram_entries = []
        for slot in backend.slots:
            slot.content, slot.n_tokens, slot.owner = None, 0, None
            if slot.phase in (SlotPhase.DRAINING, SlotPhase.EXTERNAL):
                slot.phase = SlotPhase.IDLE

    @staticmethod
    def _restarted(backend: BackendState, probe: Probe, returned: bool) -> bool:
        """Whether a READY probe shows a server other than the one last seen (module
        docstring): evidence of a restart, or a return from DOWN with none to read."""
        if backend.phase in (BackendPhase.UNKNOWN, BackendPhase.LOADING):
            return True
        if len(probe.slots) != len(backend.slots):
            return True
        if None not in (probe.identity, backend.identity) and probe.identity != backend.identity:
            return True  # another model, context or build: a restart, whatever the task ids
        if not probe.read:
            return returned
        highest = max((s.task_id for s in probe.slots), default=-1)
        return highest < backend.max_task_id or (returned and backend.max_task_id < 0)

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


def _ram_entry_of(
    backend: BackendState, slot: SlotState, prompt: Fingerprint, primed: bool = False
) -> RamEntry | None:
    """What the server parks in RAM as a task with ``prompt`` starts on ``slot``: the slot's
    content, when the prompt keeps less than half of it (else its hook does not run) or a
    primer ran the hook first (``primed``); it also moves the entry it loads into the slot,
    so an evicted session finds its content in RAM now."""
    old = slot.content
    if old is None:
        return None
    if not primed and not ram_cache.hook_runs(old, prompt, backend.kv_estimate(old, slot.n_tokens)):
        return None
    return backend.ram_entry(old, slot.last_used, slot.n_tokens)


def _loaded(backend: BackendState, old: Fingerprint | None, new: Fingerprint) -> bool:
    """Whether a slot that held ``old`` and now holds ``new`` (another replica's request) took
    a RAM entry the new content continues beyond what the old content shares with it, by more
    than a primer costs: the server's hook ran, as only a primer makes it run for a request
    keeping half of the slot (``ram_cache.PRIMER``), and the old content was parked."""
    if old is None:
        return False  # (an empty slot parks nothing)
    shared = new.tokens_at(common_segments(old.hashes, new.hashes))
    return any(  # (contained first: a longer entry has no token count in ``new``)
        ram_cache.contains(new, e.content)
        and new.tokens_at(len(e.content.hashes)) - shared > ram_cache.PRIMER_TOKENS
        for e in backend.ram_entries
    )


def _reconcile(slot: SlotState, seen_tokens: int) -> None:
    """Trim what we believe a slot holds to what ``/slots`` says its KV length is."""
    content = slot.content
    if content is None or seen_tokens >= slot.n_tokens:
        return
    if seen_tokens == 0 or slot.n_tokens == 0:
        slot.content = None
        return
    keep = content.total * seen_tokens / slot.n_tokens
    slot.content = content.prefix(sum(1 for t in content.tokens if t <= keep))


def _lapsed_unseen(backend: BackendState, sent: float) -> None:
    """A probe read no ``/slots`` (disabled, or its key not given to the proxy) though a slot
    is EXTERNAL (only another replica's lapsed lease leaves one on such a backend: a slot seen
    processing needs a read): no read will show it idle, so it is taken for idle, what it
    holds unknown, as a drain given up unseen is; only one EXTERNAL before the probe was
    sent (its lease's end dates it: ``fold_shared``)."""
    for slot in backend.slots:
        if slot.phase is SlotPhase.EXTERNAL and slot.last_used <= sent:
            slot.phase, slot.content, slot.n_tokens, slot.owner = SlotPhase.IDLE, None, 0, None


def _saved(slot: SlotState, ram_entries: list[RamEntry]) -> bool:
    """Whether ``slot`` was last saved to the RAM cache with this content into this very
    cache list (``BackendState.ram_entries`` is replaced on every change, never changed in
    place): saving it again would change nothing."""
    saved = slot.saved
    return saved is not None and saved[0] is slot.content and saved[1] is ram_entries

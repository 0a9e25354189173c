"""Choose the backend and slot whose KV cache already holds the most of a prompt.

Inputs: the request's fingerprint (hash chain + cumulative token estimates), the fleet
(every slot's phase and the chain of what its KV holds), an optional cache_key affinity
hint (backend, slot), and ``now``. Output: a ``Decision`` with a reason, or a
``NoPlacement`` when nothing can run now.

1. *Scores* (``core.routing.scoring``): per idle slot, predicted reuse (the slot's KV, the backend's
   RAM prompt cache, or a disk snapshot restored into it) minus restore cost and the recency-
   weighted damage of evicting what the slot holds. Only the slots that may rank first are
   scored in full (``core.routing.options``: another conversation's slot only while its
   bound beats the best score found, a stranger only when nothing gains), and each
   backend's slots are read grouped as the last decision left them unless the backend
   changed since (``core.routing.index``): by the head of what they hold, by recency, and
   by what overwriting them loses. A backend's RAM-cache model is compared with the prompt
   only where the index says an entry may serve more than what it is weighed against
   (``scoring.RamViews``).
2. *cache_key affinity* (done outside the server): a keyed request whose mapped
   slot is idle reuses it when the slot serves a prefix hit (``hit_floor``, the bar of step 3)
   ("reuse") and no other idle slot scores higher ("outmatched": an agent session
   alternating two prompt threads, its key mapped to the other thread's slot, which this
   request would overwrite). The key decides ties and the label, never against the score,
   and the slot it names is the best idle choice of step 3: a busy slot saving far more is
   still waited for (step 4).
   A busy mapped slot is skipped ("busy"); one serving less than a hit ("unsafe": the key
   now names an unrelated prompt) routes normally.
3. Best idle candidate by (score, -backend load, -age): "prefix" when it reuses at least
   ``min_prefix_tokens`` (or, for a shorter prompt, all of it: a short prompt repeated
   verbatim, such as an agent retrying one 14-token request 30 times, is a hit rather than a
   stranger; "disk" when that comes from a restored snapshot), else "cold": the empty or
   least valuable slot, on the less loaded backend. A slot holding another conversation
   with the same system prompt, taken because every idle slot holds another conversation,
   still serves that prompt: "prefix". There is no load gate beyond the tie on load: one
   (SGLang's absolute and relative thresholds) changed no replay row when dropped.
4. *Waiting* (``core.routing.waiting``): rather than place, wait for a busy slot, or for a full
   backend whose RAM cache holds the prefix, when that saves enough more than the best idle
   choice ("wait"); the caller re-decides when a slot frees that may change that
   (``core.routing.wakes``) and bounds the wait.

5. *Holds* (``core.routing.returns``): an idle slot its session left less than ``hold`` seconds
   ago (learned from how fast sessions come back) is not taken by another session when the
   server could not park what it holds; if every idle slot is held the request waits, until
   the session is back or the hold ends (``Decision.until``). A request that waits for
   something else while slots are held decides again when the first of those holds ends
   (``Decision.hold_end``).

*Parameters*, each with its unit and default (what dropping each rule does to the replays:
``bench.ablation``, recorded in ``bench/HISTORY.md``):

- ``min_prefix_tokens`` (tokens, 16): less reuse reports as a cold start (and a cache_key's
  slot serving less is not the session's); under saturation, the least saving worth a wait.
- ``wait_min_tokens`` (tokens, 1024) / ``wait_min_fraction`` (share of the prompt, 0.5): a
  saving worth waiting for a busy slot (half of it for a full backend's RAM copy).
- ``max_slot_wait_seconds`` (s, 5): the bound on any wait: for a busy slot, and behind a
  slot held for its session (``core.routing.returns``; a hold is a wait for whoever would
  take the slot). 0: neither.
- ``value_half_life_seconds`` (s, 600): for how long what a slot holds counts against
  overwriting it (the prior; where overwritten content is lost, the measured return odds
  replace it: ``core.routing.return_odds``).
- Constants: ``waiting.SATURATED`` (slots per idle one, 16), ``waiting.SHORT_WHOLE`` (tokens,
  4), ``waiting.SPARE_PARKED`` (tokens, 256), ``RoutingParams.ram_discount`` (share of the
  damage when the server parks the content in RAM, 0.1), ``RoutingParams.eviction_weight``
  (damage per token lost, 1: the objective's unit), ``ram_cache.SURE_CONSULT`` (share of
  a slot kept, 0.4), ``options.SPARES`` (slots, 2).

Only IDLE slots are placed (property-tested). Ties break by load, then towards a backend this
replica schedules (``remote``: the others, with several replicas; no forwarding hop for an
equal choice: a burst of new sessions, routed from one read of an empty fleet, would all go to
the lowest backend's home), then backend index and slot recency and id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from proxy.core.disk.snapshots import Offer
from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.routing.index import BackendIndex, FleetIndex
from proxy.core.routing.options import Strangers, kin, options
from proxy.core.routing.options import strangers as best_strangers
from proxy.core.routing.returns import held, held_until
from proxy.core.routing.scoring import (
    Candidate,
    RamView,
    RamViews,
    RoutingParams,
    candidate,
    predicted_reuse,
)
from proxy.core.routing.waiting import Fleetview, crowded, hit_floor, spare_parked, worth_waiting
from proxy.core.routing.wakes import Key, wake_keys
from proxy.core.server.fleet import (
    BackendPhase,
    BackendState,
    NoPlacement,
    Placement,
    SlotPhase,
    SlotState,
)
from proxy.core.server.placement import why_not

__all__ = ["Decision", "KeyOutcome", "Reason", "RoutingParams", "predicted_reuse", "route"]


class Reason(StrEnum):
    AFFINITY = "affinity"
    PREFIX = "prefix"
    DISK = "disk"  # best served by restoring a disk snapshot
    COLD = "cold"
    WAIT = "wait"


class KeyOutcome(StrEnum):
    """What became of a keyed request's cache_key affinity (step 2)."""

    REUSE = "reuse"  # its mapped slot, idle and really the session's
    BUSY = "busy"  # its mapped slot was busy
    UNSAFE = "unsafe"  # its mapped slot serves less than a hit: routed by prefix
    OUTMATCHED = "outmatched"  # another idle slot scored higher: routed by prefix


@dataclass(frozen=True)
class Decision:
    placement: Placement | None  # None when waiting for ``wait_for``
    reason: Reason
    predicted: int
    wait_for: tuple[int, int] | None = None
    key_outcome: KeyOutcome | None = None  # for keyed requests
    restore: Offer | None = None  # restore this disk snapshot into the slot first
    until: float | None = None  # waiting for a held slot: its hold ends then
    # waiting for anything else while idle slots are held: the first of those holds to end,
    # and its slot (the decision may change then: the slot is no longer held)
    hold_end: tuple[float, tuple[int, int]] | None = None
    # waiting: the releases that may change it (``core.routing.wakes``; None: any)
    wakes: frozenset[Key] | None = None


Rank = tuple[float, int, bool, int, float, int]


def _ranking(remote: frozenset[int]) -> Callable[[Candidate], Rank]:
    """Order candidates by score, then the less loaded backend, then one this replica
    schedules itself (``remote``: backends another replica schedules; no forwarding hop for
    an equal choice), then the lower backend index, the least recently used slot."""

    def rank(c: Candidate) -> Rank:
        own = c.backend.index not in remote
        return (c.score, -c.load, own, -c.backend.index, -c.slot.last_used, -c.slot.id)

    return rank


def _place(candidate: Candidate, reason: Reason, key: KeyOutcome | None = None) -> Decision:
    c = candidate
    placement = Placement(c.backend.index, (c.slot.id,), c.slot.id, c.from_ram, c.primed)
    if candidate.restore is not None and reason is Reason.PREFIX:
        reason = Reason.DISK
    return Decision(placement, reason, candidate.reuse, key_outcome=key, restore=candidate.restore)


def _affinity(
    fp: Fingerprint,
    backends: Sequence[BackendState],
    hint: tuple[int, int],
    now: float,
    params: RoutingParams,
    disk: Mapping[int, Offer],
    ram: RamViews,
    load: Mapping[int, int],
) -> tuple[Candidate | None, KeyOutcome]:
    """The hinted slot as a candidate, with the decision's RAM views and loads (every ready
    backend has both), or why not."""
    index, slot_id = hint
    if index >= len(backends) or slot_id >= len(backends[index].slots):
        return None, KeyOutcome.UNSAFE
    backend, slot = backends[index], backends[index].slots[slot_id]
    if backend.phase is not BackendPhase.READY or slot.phase is not SlotPhase.IDLE:
        return None, KeyOutcome.BUSY
    found = candidate(fp, backend, slot, now, params, ram[index], load[index], disk.get(index))
    if found.reuse >= hit_floor(fp, params):
        return found, KeyOutcome.REUSE
    return None, KeyOutcome.UNSAFE


def route(
    fp: Fingerprint,
    backends: Sequence[BackendState],
    params: RoutingParams,
    *,
    now: float,
    affinity: tuple[int, int] | None = None,
    allow_wait: bool = True,
    avoid: frozenset[int] = frozenset(),
    disk: Mapping[int, Offer] | None = None,
    queued: int = 0,
    hold: float = 0.0,
    views: dict[int, RamView] | None = None,
    remote: frozenset[int] = frozenset(),
    index: FleetIndex | None = None,
) -> Decision | NoPlacement:
    """The decision for ``fp``; ``disk``: per backend, the best snapshot it could restore;
    ``queued``: requests waiting for a slot (this one included, if it waits); ``hold``:
    seconds a freed slot is held for its session; ``views``: the request's RAM
    views, memo updated; ``remote``: backends another replica schedules (ties go to the
    others); ``index``: the fleet's slots grouped for routing, kept across decisions
    (``core.routing.index``; without it, built anew)."""
    disk, index = disk or {}, index or FleetIndex()
    usable = [b for b in backends if b.index not in avoid]
    up = [b for b in usable if b.phase is BackendPhase.READY]
    indexes: dict[int, BackendIndex] = {}
    free_of: dict[int, Sequence[SlotState]] = {}
    load: dict[int, int] = {}
    for b in up:  # (read once per decision)
        i, grouped = b.index, index.of(b)
        indexes[i], free_of[i], load[i] = grouped, grouped.idle, len(b.slots) - len(grouped.idle)
    ram = RamViews(fp, backends, up, indexes, views)  # (each worked out when first read)
    ready = [b for b in up if free_of[b.index]]
    key, keyed = None, None
    if affinity is not None and affinity[0] not in avoid:
        keyed, key = _affinity(fp, backends, affinity, now, params, disk, ram, load)
    idle_count = sum(len(free_of[b.index]) for b in ready)
    least = params.min_prefix_tokens
    spared = frozenset(
        (b.index, s.id)
        for b in (ready if allow_wait and hold > 0 else ())
        for s in _recent(indexes[b.index], now, hold)
        if held(b, s, fp, now, hold, least)
    )
    idle: list[Candidate] = []
    deferred: list[tuple[BackendState, list[SlotState], Strangers | None]] = []
    left: list[Strangers] = []
    for b in ready:
        mine = frozenset(s for i, s in spared if i == b.index) if spared else frozenset()
        found, near, others, spares = options(
            fp,
            b,
            indexes[b.index],
            mine,
            now,
            params,
            ram,
            load[b.index],
            disk.get(b.index),
        )
        idle += found
        if near or spares:
            deferred.append((b, near, spares))
        if others is not None:
            left.append(others)
    if deferred:
        top = max((c.score for c in idle), default=None)
        scored, unloaded = kin(fp, deferred, top, now, params, ram, load, disk)
        idle, left = idle + scored, left + unloaded
    if not any(c.score > 0 for c in idle):  # else no stranger (at most 0) can rank first
        idle += best_strangers(fp, left, now, params, load)
    best = max(idle, key=_ranking(remote), default=None)
    if keyed is not None and (best is None or keyed.score >= best.score):
        best = keyed  # the key decides a tie; waiting for a busy slot may still save more
    else:
        if keyed is not None:
            key = KeyOutcome.OUTMATCHED  # another idle slot scores higher: route by prefix
        if spared and len(spared) == idle_count:
            free = [(b, s) for b in ready for s in free_of[b.index]]
            # the slot whose hold ends first (to the others, its end is a release of it)
            until, wait_for = min((held_until(b, s, hold), (b.index, s.id)) for b, s in free)
            return Decision(None, Reason.WAIT, 0, wait_for, key, until=until)
    pressed = idle_count < queued  # idle slots go to waiters anyway
    fleet = Fleetview(up, free_of, crowded(idle_count, up), pressed, indexes)
    waiting = worth_waiting(fp, fleet, best, params, ram, spared, now) if allow_wait else None
    if waiting is not None:
        partial = len(up) < sum(1 for b in backends if b.phase is BackendPhase.READY)
        wakes = wake_keys(fp, *waiting, fleet, params, disk, ram, partial)
        end = _first_hold_end(backends, spared, hold)
        return Decision(None, Reason.WAIT, waiting[1], waiting[0], key, wakes=wakes, hold_end=end)
    spare = spare_parked(fleet, best) if allow_wait and best is not None else None
    if spare is not None:  # (any release may change it: no keys)
        end = _first_hold_end(backends, spared, hold)
        return Decision(None, Reason.WAIT, spare[1], spare[0], key, hold_end=end)
    if best is None:
        return why_not(backends, avoid)
    if best is keyed:
        return _place(best, Reason.AFFINITY, key)
    # every idle slot may hold another conversation: the least bad may still hold the prefix
    reason = Reason.PREFIX if best.reuse >= hit_floor(fp, params) else Reason.COLD
    return _place(best, reason, key)


def _first_hold_end(
    backends: Sequence[BackendState], spared: frozenset[tuple[int, int]], hold: float
) -> tuple[float, tuple[int, int]] | None:
    """Of the idle slots held from this request, the one whose hold ends first, and when."""
    if not spared:
        return None
    return min((held_until(backends[b], backends[b].slots[s], hold), (b, s)) for b, s in spared)


def _recent(index: BackendIndex, now: float, hold: float) -> Iterator[SlotState]:
    """The idle slots a hold may keep: used within the last ``hold`` seconds (a hold never
    outlasts that, ``returns.held_until``), the most recent first."""
    for slot in index.recent:
        if now >= slot.last_used + hold:
            return
        yield slot


def _slot(c: Candidate) -> tuple[int, int]:
    return c.backend.index, c.slot.id

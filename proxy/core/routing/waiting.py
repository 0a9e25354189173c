"""When a request should wait for a busy slot rather than take an idle one (step 4 of
``core.routing.decision``). ``worth_waiting`` returns the slot (or ``(backend, -1)``: any slot of a
full backend) and the tokens it would serve, or None; the caller re-decides whenever a slot
frees, bounds the wait, and then decides again without waiting.

- *The bar*: a busy slot (in flight, draining, or used elsewhere) must save at least
  ``wait_min_tokens`` more than the best idle choice, or ``wait_min_fraction`` of the prompt
  when that is fewer (most of a short prompt is worth a short wait too, and going elsewhere
  would evict another session). A full backend whose RAM cache holds the request's prefix
  needs half that (at least ``hit_floor``): it frees *some* slot far sooner than one given
  slot finishes its request.
- *A backend whose free slots cannot load it*: a backend whose RAM cache holds the
  request's prefix but none of whose free slots would load it (the prompt keeps half of
  their content, or they are empty: the server skips its cache), while a busy one would once
  done, counts as a full one (``_ram_wait``).
- *Only a slot it would take*: while the best idle choice is an empty slot (and the fleet is
  not saturated, below), a busy slot counts only if the request would take it once free
  (scored as ``scoring.once_done``, the score positive). A burst of new sessions sharing a
  long system prompt then starts on empty slots at once instead of queueing behind the first
  one's slot — which, free, holds another conversation they do not take — to start cold
  after it anyway (``bench.burst``). The replay traces' fleets are full of content: there
  the rule does not fire.
- *Saturation*: when at most one slot in ``SATURATED`` is idle, an idle slot elsewhere
  saves the fleet no time — the next request takes it — so any saving of
  ``min_prefix_tokens`` is worth the wait. Small fleets are never saturated while a slot
  is idle, so a lone request never waits beside an idle slot for a few tokens.
- *A parked session spared* (``spare_parked``): outside saturation a request also waits
  when pinning the best idle slot would make the server load a parked RAM entry and
  overwrite more of it than the request gains (score below ``-SPARE_PARKED``): any non-empty
  slot it keeps less than half of would load that entry, so it waits until the entry's own
  session takes it back or the bound passes.
- *Queue pressure*: when more requests wait in the proxy than slots are idle, an idle slot
  this request passes up goes to another waiter at once, so waiting for a full backend whose
  RAM cache holds its prefix costs the fleet nothing either: any saving of
  ``min_prefix_tokens`` (or all of a shorter prompt, ``hit_floor``) is worth it. Not for a
  busy slot: a full backend frees *some* slot far sooner than one given slot finishes its
  request.

There are no short queues (a small saving waited for while few requests wait for its slot,
as the server's own queue gives the routers that leave slots to it): dropped, the replay
rows stayed within their spread and their waits' latency went. The measurements behind each
rule, and what dropping each does, are in ``bench/HISTORY.md`` (``bench.ablation``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.routing.index import BackendIndex, continues
from proxy.core.routing.scoring import (
    Candidate,
    RamView,
    RamViews,
    RoutingParams,
    candidate,
    kin_reach,
    once_done,
    predicted_reuse,
)
from proxy.core.server.fleet import BackendState, SlotState

SATURATED = 16  # a fleet with at most one idle slot in this many is saturated
SHORT_WHOLE = 4  # a prompt under min_prefix_tokens is a hit when all of it (>= this) is cached
SPARE_PARKED = 256  # net tokens lost by destroying a parked RAM entry that are worth a wait


@dataclass(frozen=True)
class Fleetview:
    """The ready backends as one decision reads them: each one's idle slots (read once),
    whether the fleet is saturated (``crowded``) and whether more requests wait than slots
    are idle (``pressed``)."""

    backends: Sequence[BackendState]
    free: Mapping[int, Sequence[SlotState]]
    saturated: bool
    pressed: bool
    index: Mapping[int, BackendIndex]  # each backend's slots grouped (``core.routing.index``)


def crowded(idle: int, backends: Sequence[BackendState]) -> bool:
    """At most one slot in ``SATURATED`` idle: the next request takes any idle slot anyway."""
    return saturated(idle, sum(len(b.slots) for b in backends))


def saturated(idle: int, slots: int) -> bool:
    """``crowded`` from counts: ``idle`` slots idle of ``slots``."""
    return idle * SATURATED <= slots


def spare_parked(fleet: Fleetview, best: Candidate) -> tuple[tuple[int, int], int] | None:
    """Wait (for any slot: the caller re-decides when one frees) rather than pin the best idle
    slot when that makes the server load a parked RAM entry and overwrite more of it than the
    request gains (score below ``-SPARE_PARKED``); not in a saturated fleet, where waiting
    already happens for any saving and idle slots go to the next request."""
    if best.from_ram is None or best.score >= -SPARE_PARKED or fleet.saturated:
        return None
    index = fleet.index
    first = next(
        ((b.index, index[b.index].busy[0].id) for b in fleet.backends if index[b.index].busy), None
    )
    return (first, best.reuse) if first is not None else None


def hit_floor(fp: Fingerprint, params: RoutingParams) -> int:
    """The least reuse that counts as a prefix hit: ``min_prefix_tokens``, or a whole prompt
    shorter than that (all but the token the server always re-evaluates; at least
    ``SHORT_WHOLE`` tokens): a short prompt repeated verbatim is a hit, not a stranger."""
    return min(params.min_prefix_tokens, max(SHORT_WHOLE, fp.total - 1))


def significant(fp: Fingerprint, params: RoutingParams) -> float:
    """A saving worth a wait: ``wait_min_tokens``, or ``wait_min_fraction`` of the prompt when
    that is fewer (but at least ``min_prefix_tokens``)."""
    share = max(params.min_prefix_tokens, params.wait_min_fraction * fp.total)
    return min(params.wait_min_tokens, share)


def wait_bar(
    fp: Fingerprint, params: RoutingParams, fleet: Fleetview, whole_backend: bool
) -> float:
    """The least saving over the best idle choice worth a wait (``worth_waiting``): for a
    busy slot, ``significant`` (``hit_floor`` when the fleet is saturated); for any slot of
    a full backend (``whole_backend``), half that, or ``hit_floor`` when saturated or
    pressed."""
    hit: float = hit_floor(fp, params)
    if whole_backend:
        lowered = fleet.saturated or fleet.pressed
        return hit if lowered else max(hit, significant(fp, params) / 2)
    return hit if fleet.saturated else significant(fp, params)


def worth_waiting(
    fp: Fingerprint,
    fleet: Fleetview,
    best: Candidate | None,
    params: RoutingParams,
    ram: RamViews,
    spared: frozenset[tuple[int, int]],
    now: float,
) -> tuple[tuple[int, int], int] | None:
    """A busy slot, or a full backend whose RAM cache holds the request's prefix, that would
    save at least ``wait_min_tokens``, or ``wait_min_fraction`` of the prompt, more than the
    best idle choice (half that for a full backend; ``min_prefix_tokens`` when the fleet is
    saturated, and for a full backend when ``pressed``: more requests wait than slots are
    idle)."""
    base, saturated = (best.reuse if best is not None else 0), fleet.saturated
    floor = base + wait_bar(fp, params, fleet, whole_backend=False)
    floor_ram = base + wait_bar(fp, params, fleet, whole_backend=True)
    empty = not saturated and _only_taken(best)
    found: tuple[tuple[int, int], int] | None = None
    before: int | None = None  # the most a busy slot of another conversation saves (lazily)
    key = fp.head
    for backend in fleet.backends:  # the ready ones
        if not spared and len(fleet.free[backend.index]) == len(backend.slots):
            continue  # every slot idle and free to take: nothing to wait for
        grouped = fleet.index[backend.index]
        sharing = grouped.waiting(key) if key is not None and grouped.busy else ()
        for s in _distinct_busy(sharing) if sharing else ():
            if found is not None and not continues(fp, s.expected):
                before = kin_reach(fp)[0] if before is None else before
                if found[1] >= before:
                    continue  # it could not save more than what was found: not worked out
            reuse = predicted_reuse(fp, s, backend.exact)
            if (
                (found is None or reuse > found[1])
                and reuse >= floor
                and (not empty or _taken(fp, backend, once_done(s, now), now, params, ram))
            ):
                found = ((backend.index, s.id), reuse)
        free = fleet.free[backend.index]
        if spared:
            free = [s for s in free if (backend.index, s.id) not in spared]
        if (ram.most(backend.index) if backend.index in ram.loading else 0) < floor_ram:
            continue  # no entry serves enough (its view is not read)
        view = ram[backend.index]
        waits = _ram_wait(fp, backend, grouped, free, view, floor_ram, params, now)
        if waits and view.best >= floor_ram and (found is None or view.best > found[1]):
            found = ((backend.index, -1), view.best)
    return found


def _only_taken(best: Candidate | None) -> bool:
    """Whether a busy slot counts only if the request would take it once free: the best idle
    choice is an empty slot (outside saturation; *Only a slot it would take* above)."""
    return best is not None and best.slot.content is None


def _distinct_busy(sharing: Sequence[SlotState]) -> list[SlotState]:
    """Of the busy slots sharing a token with the prompt (``sharing``: ``index.waiting``; one
    sharing none saves nothing), the first of those that will hold the same content: the
    others would pass or fail as it does and save no more, and the first found wins."""
    seen: set[tuple[object, ...]] = set()
    out: list[SlotState] = []
    for slot in sharing:
        content = slot.expected
        assert content is not None
        key = (content.hashes[-1], content.total, slot.n_tokens, content.anchor, content.users)
        if key not in seen:
            seen.add(key)
            out.append(slot)
    return out


def _ram_wait(
    fp: Fingerprint,
    backend: BackendState,
    index: BackendIndex,
    free: Sequence[SlotState],
    view: RamView,
    floor: float,
    params: RoutingParams,
    now: float,
) -> bool:
    """Whether waiting for any slot of ``backend`` is an option: it is full (or its idle
    slots are held for their sessions), or its RAM cache gives the request its best entry,
    worth ``floor``, only in a slot that is busy now: none of its free slots would load it (a
    slot the prompt keeps half of, or an empty one, skips the cache), and some busy one
    would, once done."""
    if backend.slots and not free:
        return True
    # cheapest first: the best entry scans the whole cache, scoring slots costs more still
    if not view.served or view.best < floor:
        return False
    busy = index.busy
    if not busy:
        return False

    def serves(slot: SlotState) -> bool:
        return candidate(fp, backend, slot, now, params, view).reuse >= view.best

    return not any(serves(s) for s in free) and any(serves(once_done(s, now)) for s in busy)


def _taken(
    fp: Fingerprint,
    backend: BackendState,
    slot: SlotState,
    now: float,
    params: RoutingParams,
    ram: RamViews,
) -> bool:
    """Whether the request would take ``slot`` (idle, or a busy one as it will be once done)
    over an empty slot: a positive score."""
    return candidate(fp, backend, slot, now, params, ram[backend.index]).score > 0

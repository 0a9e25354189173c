"""When a request should wait for a busy slot rather than take an idle one (step 5 of
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
- *Short queues*: a busy slot saving only ``short_wait_tokens`` (4) more than the best idle
  choice is worth a wait too, while fewer than ``short_wait_depth`` (4) other requests wait
  for it (``depths``) and the request would take it once free over that idle choice (not
  a slot busy with a request from outside the proxy: what it will hold is unknown). The
  server's own queue does this for the routers that leave slots to it: waiters take a
  freed slot one after another, so the short prompts that share a few head tokens with a
  busy session (taubench's identical 7-token openers, its prompts opening with a shared
  7-18-token head) reuse them; the depth bounds how long the last one waits (each waits
  one request's time per waiter ahead; without the bound the waiters pile onto one slot).
  A short queue is joined only when prefilling the tokens
  it saves takes longer than its wait (``pays``: the requests ahead and the one in flight
  each hold the slot the backend's measured ``service_s``), or when more requests wait
  than slots are idle (``pressed``: the idle slot is not wasted).
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

The measurements behind each rule, and what dropping each does, are in ``bench/HISTORY.md``
(``bench.ablation``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.routing.index import BackendIndex, continues
from proxy.core.routing.scoring import (
    Candidate,
    RamView,
    RoutingParams,
    candidate,
    kin_reach,
    once_done,
    predicted_reuse,
)
from proxy.core.server.fleet import BackendState, SlotPhase, SlotState

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
    return idle * SATURATED <= sum(len(b.slots) for b in backends)


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


def worth_waiting(
    fp: Fingerprint,
    fleet: Fleetview,
    best: Candidate | None,
    params: RoutingParams,
    ram: Mapping[int, RamView],
    spared: frozenset[tuple[int, int]],
    now: float,
    depths: Mapping[tuple[int, int], int],
) -> tuple[tuple[int, int], int] | None:
    """A busy slot, or a full backend whose RAM cache holds the request's prefix, that would
    save at least ``wait_min_tokens``, or ``wait_min_fraction`` of the prompt, more than the
    best idle choice (half that for a full backend; ``min_prefix_tokens`` when the fleet is
    saturated, and for a full backend when ``pressed``: more requests wait than slots are
    idle); or a busy slot saving ``short_wait_tokens`` more that fewer than
    ``short_wait_depth`` other requests wait for (``depths``)."""
    base, saturated, pressed = (
        (best.reuse if best is not None else 0),
        fleet.saturated,
        fleet.pressed,
    )
    floor = base + (hit_floor(fp, params) if saturated else significant(fp, params))
    short = min(floor, base + (params.short_wait_tokens or floor))  # 0: off

    def bar(backend: BackendState, slot: SlotState, reuse: int) -> float:  # a busy slot's
        # an outside request's slot (EXTERNAL) will hold what it does not know: no short queue
        ahead = depths.get((backend.index, slot.id), 0)
        if ahead >= params.short_wait_depth or slot.phase is SlotPhase.EXTERNAL:
            return floor
        return short if pressed or pays(backend, reuse - base, ahead) else floor

    hit: float = hit_floor(fp, params)
    floor_ram = base + (hit if pressed or saturated else max(hit, significant(fp, params) / 2))
    empty = not saturated and _only_taken(best)
    rival = best.score if best is not None else 0.0  # a short queue's slot must beat it
    found: tuple[tuple[int, int], int] | None = None
    before: int | None = None  # the most a busy slot of another conversation saves (lazily)
    key = fp.head
    for backend in fleet.backends:  # the ready ones
        if not spared and len(fleet.free[backend.index]) == len(backend.slots):
            continue  # every slot idle and free to take: nothing to wait for
        grouped = fleet.index[backend.index]
        sharing = grouped.waiting(key) if key is not None and grouped.busy else ()
        for s in _distinct_busy(backend, sharing, fp, depths, params) if sharing else ():
            if found is not None and not continues(fp, s.expected):
                before = kin_reach(fp)[0] if before is None else before
                if found[1] >= before:
                    continue  # it could not save more than what was found: not worked out
            reuse = predicted_reuse(fp, s, backend.exact)
            if (
                (found is None or reuse > found[1])
                and reuse >= bar(backend, s, reuse)
                and (not empty or _taken(fp, backend, once_done(s, now), now, params, ram))
                and (
                    reuse >= floor
                    or _taken(fp, backend, once_done(s, now), now, params, ram, rival)
                )
            ):
                found = ((backend.index, s.id), reuse)
        free = fleet.free[backend.index]
        if spared:
            free = [s for s in free if (backend.index, s.id) not in spared]
        view = ram[backend.index]  # (no entry and a free slot: nothing to wait for)
        waits = bool(view.served or not free) and _ram_wait(
            fp, backend, grouped, free, view, floor_ram, params, now
        )
        if waits and view.best >= floor_ram and (found is None or view.best > found[1]):
            found = ((backend.index, -1), view.best)
    return found


def _only_taken(best: Candidate | None) -> bool:
    """Whether a busy slot counts only if the request would take it once free: the best idle
    choice is an empty slot (outside saturation; *Only a slot it would take* above)."""
    return best is not None and best.slot.content is None


def pays(backend: BackendState, saved: int, ahead: int) -> bool:
    """Whether prefilling ``saved`` tokens takes longer than waiting for a busy slot with
    ``ahead`` requests queued for it: each holds the slot ``service_s`` (the backend's
    measured mean; the one in flight counted whole: its time left is not known). Before any
    request on the backend completed, it is assumed to."""
    if backend.service_s is None:
        return True
    return saved / max(backend.prefill_tps, 1.0) > (ahead + 1) * backend.service_s


def _distinct_busy(
    backend: BackendState,
    sharing: Sequence[SlotState],
    fp: Fingerprint,
    depths: Mapping[tuple[int, int], int],
    params: RoutingParams,
) -> list[SlotState]:
    """Of the busy slots sharing a token with the prompt (``sharing``: ``index.waiting``; one
    sharing none saves nothing), the first of those that will hold the same content with the
    same bar (``depths`` below ``short_wait_depth`` or not, busy with an outside request or
    not): the others would pass or fail as it does and save no more, and the first found
    wins."""
    seen: set[tuple[int, int, int, bool, bool]] = set()
    out: list[SlotState] = []
    for slot in sharing:
        content = slot.expected
        assert content is not None
        queued = depths.get((backend.index, slot.id), 0) < params.short_wait_depth
        key = (
            content.hashes[-1],
            content.total,
            slot.n_tokens,
            queued,
            slot.phase is SlotPhase.EXTERNAL,
        )
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
    ram: Mapping[int, RamView],
    rival: float = 0.0,
) -> bool:
    """Whether the request would take ``slot`` (idle, or a busy one as it will be once done)
    over a choice scoring ``rival``: over an empty slot, a positive score; in a short queue,
    over the best idle choice."""
    return candidate(fp, backend, slot, now, params, ram[backend.index]).score > rival


Slot = tuple[int, int]  # (backend index, slot id)


class Depths:
    """Per busy slot, how many requests wait for it: kept as each request's decision
    changes (``move``), so reading a depth costs the same however many requests wait."""

    def __init__(self) -> None:
        self._counts: dict[Slot, int] = {}

    def move(self, old: Slot | None, new: Slot | None) -> None:
        """A request waited for ``old`` and now waits for ``new`` (None: no slot)."""
        if old is not None:
            left = self._counts[old] - 1
            if left:
                self._counts[old] = left
            else:
                del self._counts[old]
        if new is not None:
            self._counts[new] = self._counts.get(new, 0) + 1

    def others(self, own: Slot | None) -> Mapping[Slot, int]:
        """The depths as a request waiting for ``own`` sees them: without itself."""
        return _Others(self._counts, own)


class _Others(Mapping[Slot, int]):
    def __init__(self, counts: dict[Slot, int], own: Slot | None) -> None:
        self._counts, self._own = counts, own

    def __getitem__(self, slot: Slot) -> int:
        count = self._counts[slot] - (slot == self._own)
        if count <= 0:
            raise KeyError(slot)
        return count

    def get(self, slot: Slot, default: int = 0) -> int:  # type: ignore[override]
        # (one signature of the overloaded ``Mapping.get``, without the KeyError it catches:
        # read for every busy slot of every decision)
        count = self._counts.get(slot, 0) - (slot == self._own)
        return count if count > 0 else default

    def __contains__(self, slot: object) -> bool:
        return isinstance(slot, tuple) and self.get(slot, 0) > 0

    def __iter__(self) -> Iterator[Slot]:
        return (slot for slot in self._counts if slot in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

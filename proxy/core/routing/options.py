"""Which of a backend's idle slots a routing decision scores (``options``).

Slots sharing a token with the prompt (one hash compare each: segment ``Fingerprint.first``
of the prompt, since hash ``i`` of a chain covers segments ``0..i``, so a shared segment means
every one before it is shared too) are scored, one per distinct content: of slots holding
the same, the least recently used scores at least as well (the same reuse, its loss the
least recent) and wins the ranking's ties.

- Those that share the prompt's anchor too (a second hash compare: they may hold its
  conversation) are scored in full (``scoring.candidate``).
- The *kin*, sharing a token but not the anchor (another conversation under the same system
  prompt: most slots of an agent fleet), are scored in full only while they may rank first
  (``kin``): each gets a cheap upper bound (``scoring.kin_bound``: what it can gain at most,
  less what it loses at least), and they are scored in the order of their bounds until a
  bound falls below the best score found. A returning session's own slot so outscores every
  kin bound, and none is scored in full.
- A slot sharing nothing reuses nothing of its own. On a backend with no RAM entry and no
  disk snapshot for the prompt it scores minus the loss of all it holds (``_stranger_ranks``,
  without the cache model), and only the best such slot of the backend can rank first: the
  least recently used empty one if there is one (it scores 0; a stranger holding tokens
  scores less, as it loses them), else the one that costs least to lose: under the
  half-life prior one of the first few of the backend's slots ordered by loss
  (``core.routing.index``), so a few are ranked rather than all. On a backend with one, the
  first empty slot (it scores the disk gain alone: an empty pinned slot skips the RAM cache)
  and the ``SPARES`` whose content costs least to lose (the second covers a RAM entry that
  parking the first would push out) are scored in full.

So a decision scores in full the slots that may hold the prompt's conversation and a few
more per backend, and the cost of any other slot is a few attribute reads; the decision is
the one that scoring every idle slot gives (property-tested).

A stranger scores at most 0 (no reuse, a loss), so it can rank first only when no other
option gains: ``options`` leaves a backend's strangers aside, and the decision ranks them
(``strangers``) only when no option scored above 0. A returning session, or a new one whose
system prompt some slot holds, so skips the slots that share nothing with it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from proxy.core.disk.snapshots import Offer
from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.routing.index import BackendIndex, continues, head, margin
from proxy.core.routing.scoring import (
    Candidate,
    KinCeiling,
    RamViews,
    RoutingParams,
    candidate,
    kin_bound,
    kin_ceiling,
    kin_loads,
    kin_reach,
    recency,
    shared_segments,
    stranger_ceiling,
    stranger_most,
    weigher,
)
from proxy.core.server.fleet import BackendState, SlotState
from proxy.core.server.slots import kv_length

SPARES = 2  # slots sharing nothing scored in full per backend with a RAM or disk gain


class Strangers(NamedTuple):
    """A backend's idle slots sharing no token with the prompt, left aside by ``options``:
    its idle slots but those in ``skip`` (slot ids: sharing the prompt, or held). (A tuple:
    one per backend per decision, made fast.)"""

    backend: BackendState
    groups: BackendIndex
    skip: frozenset[int]

    def slots(self) -> list[SlotState]:
        return [s for s in self.groups.idle if s.id not in self.skip]


def options(
    fp: Fingerprint,
    backend: BackendState,
    index: BackendIndex,
    spared: frozenset[int],
    now: float,
    params: RoutingParams,
    ram: RamViews,
    load: int,
    offer: Offer | None,
) -> tuple[list[Candidate], list[SlotState], Strangers | None, Strangers | None]:
    """The candidates among the backend's idle slots but the ``spared`` ones (slot ids)
    one of which ranks best (module docstring), and the slots left aside: the kin, which
    ``kin`` scores when they may rank first; the strangers (None: none), which
    ``strangers`` ranks when no candidate scores above 0, or, on a backend with a RAM entry
    or a snapshot for the prompt, whose spares ``kin`` scores like the kin (the fourth;
    the third None then). ``ram``: the request's RAM views, the backend's read only when
    a slot continues the prompt. Whether an entry may come into a stranger is read from
    the index (``RamViews.may_load``: one shares the prompt's head); ``kin`` ranks the
    strangers as the others' when the view shows none serves the prompt a token."""
    key = head(fp)
    sharing = index.sharing(key) if key is not None else ()
    found: list[Candidate] = []
    kin: list[SlotState] = []
    skip = spared
    if sharing:  # (most backends of a fleet have none: their strangers alone)
        ours: list[SlotState] = []
        for slot in sharing:
            if slot.id not in spared:
                (ours if continues(fp, slot.content) else kin).append(slot)
        if len(ours) > 1:
            ours = _distinct(ours)
        if len(kin) > 1:
            kin = _distinct(kin)
        if ours:
            view = ram[backend.index]
            found = [candidate(fp, backend, s, now, params, view, load, offer) for s in ours]
        shared = frozenset(s.id for s in sharing)
        skip = spared | shared if spared else shared
    strangers = Strangers(backend, index, skip) if len(skip) < len(index.idle) else None
    gains = offer is not None or ram.may_load(backend.index)
    if strangers is not None and gains:  # a RAM entry or a snapshot may come into any of them
        return found, kin, None, strangers
    return found, kin, strangers, None


def kin(
    fp: Fingerprint,
    deferred: Sequence[tuple[BackendState, Sequence[SlotState], Strangers | None]],
    top: float | None,
    now: float,
    params: RoutingParams,
    ram: RamViews,
    load: Mapping[int, int],
    disk: Mapping[int, Offer],
) -> tuple[list[Candidate], list[Strangers]]:
    """The kin slots and spare strangers (``options``: per backend, the kin and the
    strangers whose ``_cheapest`` are the spares) that may beat ``top``, the best score so
    far, scored in full in order of their bound (``scoring.kin_bound``; a spare stranger
    reuses nothing of its own, so the server may park all of it): once a bound falls below
    the best score found, none left can rank first. A backend whose most gain is below
    ``top`` is passed over whole: no bound exceeds the gain. A backend's spares are found
    only once the most any of them can score (``scoring.stranger_most``) is the highest bound
    left: a new session under a system prompt that every backend's RAM cache holds would
    make each of them load a parked session and destroy it, and scores one or two. Second:
    the strangers of a backend whose entries share the prompt's head but none serves it a
    token, and with no snapshot to restore (``options`` could not tell without its view):
    nothing comes into them, so they are ranked as any other backend's (``strangers``)."""
    heap: list[tuple[float, int, BackendState, SlotState | Strangers, KinCeiling | None]] = []
    left: list[Strangers] = []
    reach, order = kin_reach(fp), itertools.count()  # (the order breaks ties: no compare)
    for backend, near, strangers in deferred:
        i, offer = backend.index, disk.get(backend.index)
        # its view is read only if an entry may beat top (with no entry sharing the prompt's
        # head, it is a view with nothing in it)
        if top is not None and ram.may_load(i):
            restored = offer.reuse - offer.cost if offer is not None else 0
            if max(reach[0], ram.most(i), restored) < top:
                continue
        view = ram[i]
        ceiling = kin_ceiling(reach, backend, view, offer)
        if top is not None and ceiling.gain < top:
            continue
        if ceiling.loads is None:  # (a load nets less than what it serves)
            ceiling = kin_loads(ceiling, view, now, params, backend)
        for s in near:
            bound = kin_bound(fp, backend, s, now, params, ceiling)
            heap.append((-bound, next(order), backend, s, None))
        if strangers is not None and offer is None and not view.loadable:
            left.append(strangers)
        elif strangers is not None:
            bare = stranger_ceiling(ceiling, view, now, params, backend)
            most = stranger_most(bare, params, strangers.groups.hollow)
            heap.append((-most, next(order), backend, strangers, bare))
    heapq.heapify(heap)
    out: list[Candidate] = []
    while heap:
        bound, _, backend, item, theirs = heapq.heappop(heap)
        if top is not None and -bound < top:
            break
        i = backend.index
        if isinstance(item, Strangers):  # (their most is the highest bound left: the spares)
            assert theirs is not None
            for s in _cheapest(item, now, params):
                spare = kin_bound(fp, backend, s, now, params, theirs)
                heapq.heappush(heap, (-spare, next(order), backend, s, None))
            continue
        found = candidate(fp, backend, item, now, params, ram[i], load[i], disk.get(i))
        out.append(found)
        top = found.score if top is None else max(top, found.score)
    return out, left


def strangers(
    fp: Fingerprint,
    left: Sequence[Strangers],
    now: float,
    params: RoutingParams,
    load: Mapping[int, int],
) -> list[Candidate]:
    """Each backend's best stranger (``options`` left them aside) that may rank first: the
    least recently used empty slot if there is one (it scores 0; a stranger holding tokens
    less, as it loses them), else the one whose content costs least to lose. Under the
    half-life prior only the first few of a backend's slots by loss are ranked
    (``index.least_lost``), and only on the backends whose least loss is within the rounding
    margin of the fleet's least (the weight's factor of ``now`` is common to all): a larger
    loss scores less."""
    windows = [(_window(fp, s, now, params), s) for s in left]
    least = min((log for (log, _), _ in windows if log is not None), default=math.inf)
    limit, out = margin(least), []
    for (log, slots), found in windows:
        if not slots or (log is not None and log > limit):
            continue
        backend = found.backend
        # (ranks differ in the slot id, so the slots themselves are never compared)
        best = max(_stranger_ranks(fp, backend, now, params, fp.first, slots))
        out.append(Candidate(backend, best[3], 0, best[0], load[backend.index]))
    return out


def _window(
    fp: Fingerprint, strangers: Strangers, now: float, params: RoutingParams
) -> tuple[float | None, Sequence[SlotState]]:
    """The strangers of one backend of which ``strangers`` ranks the best, and their least
    log loss (None: not known, the best is ranked among all of them)."""
    backend, index, skip = strangers
    empties = [s for s in index.empty if s.id not in skip] if index.empty else []
    if empties and params.eviction_weight > 0 and params.ram_discount > 0:
        return -math.inf, empties[:1]  # it scores 0: a loss of 0
    returns = params.returns is not None and (backend.exact or not backend.ram)
    if (
        params.eviction_weight > 0
        and not returns
        and fp.first >= 0
        and index.latest <= now
        and not 0 < index.anchored <= fp.first
    ):
        found = index.cheapest(params.value_half_life_s, params.ram_discount, skip)
        if found is not None:
            log, window = found
            return (-math.inf if empties else log), [*window, *empties]
    return None, strangers.slots()


def _distinct(slots: Sequence[SlotState]) -> list[SlotState]:
    """Of slots holding the same content, the least recently used: it scores at least as
    well as the others (the same reuse, its loss the least recent). The same content: the
    same chain, KV length, anchor and user messages (which tell its conversation apart)."""
    seen: dict[tuple[object, ...], SlotState] = {}
    for slot in slots:
        content = slot.content
        assert content is not None
        key = (content.hashes[-1], content.total, slot.n_tokens, content.anchor, content.users)
        kept = seen.get(key)
        if kept is None or _lru(slot) < _lru(kept):
            seen[key] = slot
    return list(seen.values())


def _cheapest(strangers: Strangers, now: float, params: RoutingParams) -> list[SlotState]:
    """The first empty slot and the ``SPARES`` whose content costs least to lose: under the
    half-life prior, on an index read before (``index.kept_by_loss``), those are among the
    first few of the backend's slots by loss (``index.least_lost``; their losses then ranked
    exactly), else all are ranked. Where the server parks what they hold at no cost (a RAM
    discount of 0), or a loss counts nothing (an eviction weight of 0), none loses anything:
    the spares are the ranking's ties, the least recently used. Where they hold both raw and
    chat prompts' contents on a backend with the RAM cache, every one is a spare: a raw
    prompt's content has no anchor, so it counts as the request's own (``scoring.candidate``)
    and a restore into its slot loses it undiscounted, while a load parks it like any other:
    one discount does not order them."""
    backend, index, skip = strangers
    empty = next((s for s in index.empty if s.id not in skip), None)
    if backend.ram and index.mixed:  # (the discount may differ from slot to slot: all)
        held = [s for s in strangers.slots() if s.content is not None]
        return held + ([empty] if empty is not None else [])
    # (one factor for every slot; none when a loss counts nothing: the ties, least recent first)
    parks = (params.ram_discount if backend.ram else 1.0) if params.eviction_weight else 0.0

    def cost(slot: SlotState) -> tuple[float, float, int]:
        assert slot.content is not None
        lost = max(slot.content.total, backend.kv_estimate(slot.content, slot.n_tokens))
        return (lost * recency(slot, now, params, backend) * parks, *_lru(slot))

    returns = params.returns is not None and (backend.exact or not backend.ram)
    kept = None
    if not returns and index.latest <= now and parks > 0:
        kept = index.cheapest(params.value_half_life_s, 1.0, skip, SPARES)
    slots = kept[1] if kept is not None else strangers.slots()
    held = [s for s in slots if s.content is not None]
    return sorted(held, key=cost)[:SPARES] + ([empty] if empty is not None else [])


def _stranger_ranks(
    fp: Fingerprint,
    backend: BackendState,
    now: float,
    params: RoutingParams,
    first: int,
    slots: Sequence[SlotState],
) -> list[tuple[float, float, int, SlotState]]:
    """Each stranger's score (``candidate``'s for a slot sharing nothing with the prompt on a
    backend with nothing to load or restore for it: no reuse, and the loss of all it holds),
    the ranking's ties after it (the least recently used, then the lowest id) and the slot:
    the rules are looked up once per backend and the loop kept lean."""
    weight, scale, w = (
        weigher(now, params, backend),
        backend.token_scale or 1.0,
        params.eviction_weight,
    )
    parks = params.ram_discount if backend.ram else 1.0
    out = []
    for slot in slots:
        content = slot.content
        if content is None or not fp.hashes:
            out.append((0.0, -slot.last_used, -slot.id, slot))
            continue
        # it shares no token, so it loses all of its KV (``lost_tokens`` with no reuse)
        length = kv_length(content, slot.n_tokens, scale)
        # the segments it shares hold no token: its conversation only when it has no more
        ours = content.anchor <= first and content.same_conversation(shared_segments(fp, content))
        discount = parks if length > 0 and not ours else 1.0
        damage = length * weight(slot.last_used) * discount
        out.append((-w * damage, -slot.last_used, -slot.id, slot))
    return out


def _lru(slot: SlotState) -> tuple[float, int]:
    return (slot.last_used, slot.id)

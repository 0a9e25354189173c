"""Choose the backend and slot whose KV cache already holds the most of a prompt.

Inputs: the request's fingerprint (hash chain + cumulative token estimates), the fleet
(every slot's phase and the chain of what its KV holds), an optional cache_key affinity
hint (backend, slot), and ``now``. Output: a ``Decision`` with a reason, or a
``NoPlacement`` when nothing can run now.

1. *Predicted reuse* of slot s: the tokens of the longest common segment prefix of the
   request and s's content, capped at the prompt length minus one (llama-server always
   re-evaluates a token). On backends marked ``exact`` (hybrid, recurrent, or sliding-window
   models without ``--swa-full``) a slot counts only if its whole content is a strict prefix
   of the request: those models cannot roll back into the middle of a cached sequence.
   llama-server's host-RAM prompt cache is modelled per backend (``BackendState.ghosts``:
   contents its slots held that were overwritten): pinning to a non-empty slot that would
   lose more than half its content makes the server load the best RAM entry instead, so a
   session parked there is predicted to come back whole (``predicted_reuse``).
2. *Eviction damage* of s, weighted by recency ``0.5 ** (age / value_half_life_s)``: when
   the request continues s's conversation (the shared prefix reaches s's first user message,
   ``Fingerprint.same_conversation``), only the tail it overwrites (s's tokens beyond the
   shared prefix); otherwise s's whole content, since that conversation loses its slot.
   Content of another conversation evicted on a backend with the RAM cache, by a request
   that keeps less than half of it, is parked there rather than lost (and comes back the
   same way), so its damage is scaled by ``ram_discount``.
   *Score* = reuse - ``eviction_weight`` * damage. So a continuing session scores its whole
   history, while a new session that shares only the system prompt with another session's
   slot prefers an empty or stale slot to taking that one.
3. *cache_key affinity* (seed 000, done outside the server): a keyed request whose mapped
   slot is idle reuses it only when the overlap is real — predicted reuse / prompt tokens
   >= ``key_similarity`` and reuse >= ``key_min_prefix`` tokens ("reuse"). A busy mapped slot is
   skipped ("busy"); a too-small overlap ("unsafe") routes normally.
4. *Load gate* (like SGLang's cache-aware policy): with ``load`` = busy slots of a backend,
   the fleet is imbalanced when ``max - min > balance_abs`` and ``max > balance_rel * min``.
   Then a best candidate on a backend loaded above ``min + balance_abs`` is dropped for the
   least loaded backend ("balance"), so a hot prefix does not pile onto one backend.
5. Best idle candidate by (score, -backend load, -age) with reuse >= ``min_prefix_tokens``
   and a positive score: "prefix". Otherwise "cold": among backends loaded at most
   ``balance_abs`` above the least loaded one, the idle slot with the best score (empty or
   least valuable first, then the less loaded backend). "balance" does the same restricted
   to the least loaded backends.
6. *Waiting*: if a slot that is busy (in flight, draining, or used elsewhere), or a backend
   with no idle slot whose RAM cache holds the request's prefix (``wait_for`` slot -1: any
   of its slots), would save at least ``wait_min_tokens`` more than the best idle choice,
   and waiting is allowed, the decision is to wait ("wait"); the caller re-decides whenever
   a slot frees, bounds the wait, and then decides again without it.

Never is a slot that is not IDLE placed (property-tested). Ties break by backend index and
slot id, so the same inputs always give the same decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from proxy.core.fingerprint import Fingerprint, common_segments
from proxy.core.fleet import (
    BackendPhase,
    BackendState,
    NoPlacement,
    Placement,
    SlotPhase,
    SlotState,
)
from proxy.core.placement import why_not


class Reason(StrEnum):
    AFFINITY = "affinity"
    PREFIX = "prefix"
    COLD = "cold"
    BALANCE = "balance"
    WAIT = "wait"


@dataclass(frozen=True)
class RoutingParams:
    min_prefix_tokens: int = 16
    wait_min_tokens: int = 1024
    eviction_weight: float = 1.0
    value_half_life_s: float = 600.0
    balance_abs: int = 2
    balance_rel: float = 1.5
    key_similarity: float = 0.5
    key_min_prefix: int = 64
    ram_discount: float = 0.1  # eviction damage when the evicted content stays in host RAM


@dataclass(frozen=True)
class Decision:
    placement: Placement | None  # None when waiting for ``wait_for``
    reason: Reason
    predicted: int
    wait_for: tuple[int, int] | None = None
    key_outcome: str | None = None  # reuse | busy | unsafe, for keyed requests


@dataclass(frozen=True)
class _Candidate:
    backend: BackendState
    slot: SlotState
    reuse: int
    score: float
    load: int  # busy slots of the backend when the decision was made


def _shared(fp: Fingerprint, content: Fingerprint | None) -> int:
    return common_segments(fp.hashes, content.hashes) if content is not None else 0


def _reuse(fp: Fingerprint, content: Fingerprint, exact: bool, shared: int | None = None) -> int:
    shared = _shared(fp, content) if shared is None else shared
    if exact and (shared < len(content.hashes) or shared == len(fp.hashes)):
        return 0
    return max(0, min(fp.tokens_at(shared), fp.total - 1))


def predicted_reuse(fp: Fingerprint, slot: SlotState, exact: bool, parked: int = 0) -> int:
    """Tokens the server will reuse if the request is pinned to ``slot``.

    Besides the slot's own content, llama-server's RAM prompt cache (``parked``: the best
    reuse any entry parked there offers, ``_ghost_reuse``) is consulted when the pinned slot
    would lose more than half its content (``f_keep < 0.5``) and is not empty (an empty pinned
    slot skips the cache, upstream #28139).
    """
    content = slot.expected
    if content is None or not fp.hashes:
        return 0
    direct = _reuse(fp, content, exact)
    if parked > direct and content.total and direct / content.total < 0.5:
        return parked
    return direct


def _recency(slot: SlotState, now: float, params: RoutingParams) -> float:
    age = max(0.0, now - slot.last_used)
    return float(0.5 ** (age / params.value_half_life_s))


def _candidate(
    fp: Fingerprint,
    backend: BackendState,
    slot: SlotState,
    now: float,
    params: RoutingParams,
    parked: int = 0,
    load: int = 0,
) -> _Candidate:
    content = slot.content  # an idle slot: what its KV holds
    if content is None or not fp.hashes:
        return _Candidate(backend, slot, 0, 0.0, load)
    shared = _shared(fp, content)
    direct = _reuse(fp, content, backend.exact, shared)
    keeps_half = content.total > 0 and direct >= 0.5 * content.total
    reuse = parked if parked > direct and not keeps_half and content.total else direct
    ours = content.same_conversation(shared)
    lost = max(0, content.total - reuse) if ours else content.total
    # Another conversation's content is parked in host RAM, and can come back later, only
    # when this request keeps less than half of it (the server's own f_keep < 0.5 rule).
    discount = params.ram_discount if backend.ram and not ours and not keeps_half else 1.0
    damage = lost * _recency(slot, now, params) * discount
    return _Candidate(backend, slot, reuse, reuse - params.eviction_weight * damage, load)


def _imbalanced(loads: Sequence[int], params: RoutingParams) -> bool:
    high, low = max(loads), min(loads)
    return high - low > params.balance_abs and high > params.balance_rel * low


def _rank(candidate: _Candidate) -> tuple[float, int, int, float, int]:
    c = candidate
    return (c.score, -c.load, -c.backend.index, -c.slot.last_used, -c.slot.id)


def _cold(
    fp: Fingerprint,
    ready: Sequence[BackendState],
    now: float,
    params: RoutingParams,
    reason: Reason,
) -> Decision:
    loads = {b.index: b.busy_count() for b in ready}
    least = min(loads.values())
    limit = least if reason is Reason.BALANCE else least + params.balance_abs
    options = [
        _candidate(fp, b, s, now, params, _ghost_reuse(fp, b), loads[b.index])
        for b in ready
        if loads[b.index] <= limit
        for s in b.idle_slots()
    ]
    return _place(max(options, key=_rank), reason)


def _place(candidate: _Candidate, reason: Reason, key: str | None = None) -> Decision:
    placement = Placement(candidate.backend.index, (candidate.slot.id,), candidate.slot.id)
    return Decision(placement, reason, candidate.reuse, key_outcome=key)


def _affinity(
    fp: Fingerprint,
    backends: Sequence[BackendState],
    hint: tuple[int, int],
    now: float,
    params: RoutingParams,
) -> tuple[_Candidate | None, str]:
    index, slot_id = hint
    if index >= len(backends) or slot_id >= len(backends[index].slots):
        return None, "unsafe"
    backend, slot = backends[index], backends[index].slots[slot_id]
    if backend.phase is not BackendPhase.READY or slot.phase is not SlotPhase.IDLE:
        return None, "busy"
    found = _candidate(
        fp, backend, slot, now, params, _ghost_reuse(fp, backend), backend.busy_count()
    )
    similar = fp.total > 0 and found.reuse / fp.total >= params.key_similarity
    if similar and found.reuse >= params.key_min_prefix:
        return found, "reuse"
    return None, "unsafe"


def route(
    fp: Fingerprint,
    backends: Sequence[BackendState],
    params: RoutingParams,
    *,
    now: float,
    affinity: tuple[int, int] | None = None,
    allow_wait: bool = True,
    avoid: frozenset[int] = frozenset(),
) -> Decision | NoPlacement:
    usable = [b for b in backends if b.index not in avoid]
    ready = [b for b in usable if b.phase is BackendPhase.READY and b.idle_slots()]
    key = None
    if affinity is not None and affinity[0] not in avoid:
        chosen, key = _affinity(fp, backends, affinity, now, params)
        if chosen is not None:
            return _place(chosen, Reason.AFFINITY, key)
    parked = {b.index: _ghost_reuse(fp, b) for b in usable if b.phase is BackendPhase.READY}
    load = {b.index: b.busy_count() for b in usable if b.phase is BackendPhase.READY}
    idle = [
        _candidate(fp, b, s, now, params, parked[b.index], load[b.index])
        for b in ready
        for s in b.idle_slots()
    ]
    best = max(idle, key=_rank, default=None)
    waiting = _worth_waiting(fp, usable, best, params, parked) if allow_wait else None
    if waiting is not None:
        return Decision(None, Reason.WAIT, waiting[1], waiting[0], key)
    if best is None:
        return why_not(backends, avoid)
    loads = list(load.values())
    if _imbalanced(loads, params) and best.load > min(loads) + params.balance_abs:
        return _with_key(_cold(fp, ready, now, params, Reason.BALANCE), key)
    if best.reuse >= params.min_prefix_tokens and best.score > 0:
        return _place(best, Reason.PREFIX, key)
    return _with_key(_cold(fp, ready, now, params, Reason.COLD), key)


def _with_key(decision: Decision, key: str | None) -> Decision:
    if key is None:
        return decision
    return Decision(decision.placement, decision.reason, decision.predicted, key_outcome=key)


def _ghost_reuse(fp: Fingerprint, backend: BackendState) -> int:
    """What the backend's RAM prompt cache could restore for this request."""
    best = 0
    for ghost in backend.ghosts if backend.ram else ():
        reuse = _reuse(fp, ghost, backend.exact)
        if ghost.total and reuse / ghost.total >= 0.25:
            best = max(best, reuse)
    return best


def _worth_waiting(
    fp: Fingerprint,
    backends: Sequence[BackendState],
    best: _Candidate | None,
    params: RoutingParams,
    parked: dict[int, int],
) -> tuple[tuple[int, int], int] | None:
    """A busy slot, or a full backend whose RAM cache holds the request's prefix, that would
    save at least ``wait_min_tokens`` more than the best idle choice."""
    floor = (best.reuse if best is not None else 0) + params.wait_min_tokens
    found: tuple[tuple[int, int], int] | None = None
    for backend in backends:
        if backend.phase is not BackendPhase.READY:
            continue
        options = [
            ((backend.index, slot.id), predicted_reuse(fp, slot, backend.exact))
            for slot in backend.slots
            if slot.phase is not SlotPhase.IDLE
        ]
        if backend.slots and not backend.idle_slots():
            options.append(((backend.index, -1), parked[backend.index]))
        for where, reuse in options:
            if reuse >= floor and (found is None or reuse > found[1]):
                found = (where, reuse)
    return found

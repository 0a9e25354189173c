"""Which of a backend's idle slots a routing decision scores (``options``).

Slots sharing a token with the prompt (one hash compare each: segment ``first_token`` of
the prompt, since hash ``i`` of a chain covers segments ``0..i``) are scored in full
(``scoring.candidate``), one per distinct content: of slots holding the same, the least
recently used scores at least as well (the same reuse, its loss the least recent) and wins
the ranking's ties. A slot sharing nothing reuses nothing of its own. On a backend with no
RAM entry and no disk snapshot for the prompt it scores minus the loss of all it holds
(``_stranger``, without the cache model), and only the best such slot of the backend can
rank first: the least recently used empty one if there is one (it scores 0; a stranger
holding tokens scores less, as it loses them). On a backend with one, the first empty slot
(it scores the disk gain alone: an empty pinned slot skips the RAM cache) and the
``SPARES`` whose content costs least to lose (the second covers a RAM entry that parking
the first would push out) are scored in full.
So a decision scores the slots that share the prompt and a few more per backend, and the
cost of a slot that shares nothing is a few attribute reads; the decision is the one that
scoring every idle slot gives (property-tested).

A stranger scores at most 0 (no reuse, a loss), so it can rank first only when no other
option gains: ``options`` leaves a backend's strangers aside, and the decision ranks them
(``stranger``) only when no option scored above 0. A returning session, or a new one whose
system prompt some slot holds, so skips the slots that share nothing with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from proxy.core.disk.snapshots import Offer
from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.routing.scoring import (
    Candidate,
    RamView,
    RoutingParams,
    candidate,
    recency,
    shared_segments,
)
from proxy.core.server.fleet import BackendState, SlotState
from proxy.core.server.slots import kv_length

SPARES = 2  # slots sharing nothing scored in full per backend with a RAM or disk gain


def shares(fp: Fingerprint, content: Fingerprint | None, first: int) -> bool:
    """Whether ``content`` holds at least one token of the prompt: its segment ``first``,
    the prompt's first holding a token (``first_token``; chains: hash ``i`` covers
    segments ``0..i``, so a shared segment means every one before it is shared too)."""
    if content is None or first < 0 or len(content.hashes) <= first:
        return False
    return content.hashes[first] == fp.hashes[first]


def first_token(fp: Fingerprint) -> int:
    """The prompt's first segment holding a token (-1: none; a chat preamble may be empty)."""
    return next((i for i, tokens in enumerate(fp.tokens) if tokens > 0), -1)


def options(
    fp: Fingerprint,
    backend: BackendState,
    idle: Sequence[SlotState],
    now: float,
    params: RoutingParams,
    ram: RamView,
    load: int,
    offer: Offer | None,
) -> tuple[list[Candidate], list[SlotState]]:
    """The candidates among ``idle`` one of which ranks best (module docstring), and the
    strangers left aside: ``stranger`` ranks them when no candidate scores above 0."""
    sharing: list[SlotState] = []
    others: list[SlotState] = []
    first = first_token(fp)
    for slot in idle:
        (sharing if shares(fp, slot.content, first) else others).append(slot)
    found = [
        candidate(fp, backend, slot, now, params, ram, load, offer) for slot in _distinct(sharing)
    ]
    if offer is not None or any(served for served, _ in ram.served):
        return found + [  # a RAM entry or a snapshot may come into any of them
            candidate(fp, backend, slot, now, params, ram, load, offer)
            for slot in _cheapest(others, backend, now, params)
        ], []
    return found, others


def stranger(
    fp: Fingerprint,
    backend: BackendState,
    others: Sequence[SlotState],
    now: float,
    params: RoutingParams,
    load: int,
) -> Candidate | None:
    """The best of a backend's strangers (``options``): the least recently used empty slot
    if there is one (it scores 0; a stranger holding tokens less, as it loses them), else
    the one whose content costs least to lose."""
    if not others:
        return None
    empty = min((s for s in others if s.content is None), key=_lru, default=None)
    if empty is not None and params.eviction_weight > 0 and params.ram_discount > 0:
        return _stranger(fp, backend, empty, now, params, load)
    # (ranks differ in the slot id, so the slots themselves are never compared)
    best = max(map(partial(_stranger_rank, fp, backend, now, params, first_token(fp)), others))
    return Candidate(backend, best[3], 0, best[0], load)


def _distinct(slots: Sequence[SlotState]) -> list[SlotState]:
    """Of slots holding the same content, the least recently used: it scores at least as
    well as the others (the same reuse, its loss the least recent)."""
    seen: dict[tuple[int, int, int], SlotState] = {}
    for slot in slots:
        content = slot.content
        assert content is not None
        key = (content.hashes[-1], content.total, slot.n_tokens)
        kept = seen.get(key)
        if kept is None or _lru(slot) < _lru(kept):
            seen[key] = slot
    return list(seen.values())


def _cheapest(
    slots: Sequence[SlotState], backend: BackendState, now: float, params: RoutingParams
) -> list[SlotState]:
    """The first empty slot and the ``SPARES`` whose content costs least to lose."""
    empty = min((s for s in slots if s.content is None), key=_lru, default=None)

    def cost(slot: SlotState) -> tuple[float, float, int]:
        assert slot.content is not None
        lost = max(slot.content.total, backend.kv_estimate(slot.content, slot.n_tokens))
        return (lost * recency(slot, now, params, backend), *_lru(slot))

    held = sorted((s for s in slots if s.content is not None), key=cost)[:SPARES]
    return held + ([empty] if empty is not None else [])


def _stranger(
    fp: Fingerprint,
    backend: BackendState,
    slot: SlotState,
    now: float,
    params: RoutingParams,
    load: int,
) -> Candidate:
    """``candidate`` for a slot sharing nothing with the prompt on a backend with nothing
    to load or restore for it: no reuse, and the loss of all it holds."""
    score = _stranger_rank(fp, backend, now, params, first_token(fp), slot)[0]
    return Candidate(backend, slot, 0, score, load)


def _stranger_rank(
    fp: Fingerprint,
    backend: BackendState,
    now: float,
    params: RoutingParams,
    first: int,
    slot: SlotState,
) -> tuple[float, float, int, SlotState]:
    """A stranger's score (``_stranger``), the ranking's ties after it (the least recently
    used, then the lowest id) and the slot: one call per idle slot sharing nothing, so kept
    lean."""
    content = slot.content
    if content is None or not fp.hashes:
        return (0.0, -slot.last_used, -slot.id, slot)
    # it shares no token, so it loses all of its KV (``lost_tokens`` with no reuse)
    length = kv_length(content, slot.n_tokens, backend.token_scale or 1.0)
    # the segments it shares hold no token: its conversation only when it has no more
    ours = content.anchor <= first and content.same_conversation(shared_segments(fp, content))
    discount = params.ram_discount if backend.ram and length > 0 and not ours else 1.0
    damage = length * recency(slot, now, params, backend) * discount
    return (-params.eviction_weight * damage, -slot.last_used, -slot.id, slot)


def _lru(slot: SlotState) -> tuple[float, int]:
    return (slot.last_used, slot.id)

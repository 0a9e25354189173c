"""How much of a prompt a slot serves, and what taking the slot costs: one candidate's score.

1. *Predicted reuse* of slot s: the tokens of the longest common segment prefix of the
   request and s's content, capped at the prompt length minus one (llama-server always
   re-evaluates a token). On backends marked ``exact`` (hybrid, recurrent, or sliding-window
   models without ``--swa-full``) a slot counts only if its whole content is a strict prefix
   of the request: those models cannot roll back into the middle of a cached sequence.
   llama-server's host-RAM prompt cache is modelled per backend (``BackendState.ghosts``:
   contents its slots held that were overwritten): pinning to a non-empty slot that would
   lose more than half its content makes the server load the best RAM entry instead, so a
   session parked there is predicted to come back whole (``predicted_reuse``).
2. *Disk*: a snapshot of a prefix of the request restorable on the backend (``Offer`` from
   ``core.snapshots``) serves its tokens in any idle slot, at the restore's cost in
   prefill-token equivalents; the candidate restores when that nets more than the slot's
   own reuse.
3. *Eviction damage* of s, weighted by recency ``0.5 ** (age / value_half_life_s)``: when
   the request continues s's conversation (the shared prefix reaches s's first user message,
   ``Fingerprint.same_conversation``), only the tail it overwrites (s's tokens beyond the
   shared prefix); otherwise s's whole content, since that conversation loses its slot.
   Content of another conversation evicted on a backend with the RAM cache, by a request
   that keeps less than half of it, is parked there rather than lost (and comes back the
   same way), so its damage is scaled by ``ram_discount``.
   *Score* = reuse - restore cost - ``eviction_weight`` * damage. So a continuing session
   scores its whole history, while a new session that shares only the system prompt with
   another session's slot prefers restoring it from disk into an empty or stale slot, or
   re-prefilling it there, to taking that slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.core.fingerprint import Fingerprint, common_segments
from proxy.core.fleet import BackendState, SlotState
from proxy.core.snapshots import Offer


@dataclass(frozen=True)
class RoutingParams:
    min_prefix_tokens: int = 16
    wait_min_tokens: int = 1024
    wait_min_fraction: float = 0.5  # ... or this share of the prompt, if smaller
    eviction_weight: float = 1.0
    value_half_life_s: float = 600.0
    balance_abs: int = 2
    balance_rel: float = 1.5
    key_similarity: float = 0.5
    key_min_prefix: int = 64
    ram_discount: float = 0.1  # eviction damage when the evicted content stays in host RAM


@dataclass(frozen=True)
class Candidate:
    backend: BackendState
    slot: SlotState
    reuse: int
    score: float
    load: int  # busy slots of the backend when the decision was made
    restore: Offer | None = None  # restore this snapshot into the slot first


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
    reuse any entry parked there offers, ``ghost_reuse``) is consulted when the pinned slot
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


def recency(slot: SlotState, now: float, params: RoutingParams) -> float:
    age = max(0.0, now - slot.last_used)
    return float(0.5 ** (age / params.value_half_life_s))


def candidate(
    fp: Fingerprint,
    backend: BackendState,
    slot: SlotState,
    now: float,
    params: RoutingParams,
    parked: int = 0,
    load: int = 0,
    offer: Offer | None = None,
) -> Candidate:
    content = slot.content  # an idle slot: what its KV holds
    live, shared, keeps_half = 0, 0, False
    if content is not None and fp.hashes:
        shared = _shared(fp, content)
        direct = _reuse(fp, content, backend.exact, shared)
        keeps_half = content.total > 0 and direct >= 0.5 * content.total
        live = parked if parked > direct and not keeps_half and content.total else direct
    restore = offer if offer is not None and offer.reuse - offer.cost > live else None
    reuse, gain = (restore.reuse, restore.reuse - restore.cost) if restore else (live, live)
    if content is None or not fp.hashes:
        return Candidate(backend, slot, reuse, gain, load, restore)
    keeps_half = keeps_half and restore is None
    ours = content.same_conversation(shared)
    lost = max(0, content.total - reuse) if ours else content.total
    # Another conversation's content is parked in host RAM, and can come back later, only
    # when this request keeps less than half of it (the server's own f_keep < 0.5 rule).
    discount = params.ram_discount if backend.ram and not ours and not keeps_half else 1.0
    damage = lost * recency(slot, now, params) * discount
    return Candidate(backend, slot, reuse, gain - params.eviction_weight * damage, load, restore)


def ghost_reuse(fp: Fingerprint, backend: BackendState) -> int:
    """What the backend's RAM prompt cache would restore for this request: the server scans
    its entries oldest first and takes each that keeps at least a quarter of itself and
    beats the best so far in both kept share and similarity to the prompt; the last taken
    wins (so an older short entry can shadow a newer, longer one)."""
    best, keep_best, sim_best = 0, 0.0, 0.0
    for ghost in reversed(backend.ghosts) if backend.ram and fp.total else ():
        reuse = _reuse(fp, ghost, backend.exact)
        keep, sim = (reuse / ghost.total if ghost.total else 0.0), reuse / fp.total
        if keep >= 0.25 and keep > keep_best and sim > sim_best:
            best, keep_best, sim_best = reuse, keep, sim
    return best

"""How much of a prompt a slot serves, and what taking the slot costs: one candidate's score.

1. *Predicted reuse* of slot s: the tokens of the longest common segment prefix of the
   request and s's content, capped at the prompt length minus one (llama-server always
   re-evaluates a token). On backends marked ``exact`` (hybrid, recurrent, or sliding-window
   models without ``--swa-full``; ``core.server.reuse_rules``) a slot counts whole only if its whole
   content is a strict prefix of the request: those models cannot roll back into the middle
   of a cached sequence, except to a checkpoint: for a chat content, the start of its last
   user message the request shares.
   llama-server's host-RAM prompt cache is modelled per backend (``BackendState.ram_entries``:
   contents its slots held that were overwritten; ``core.server.ram_cache``): pinning to a
   non-empty slot that would lose more than half its content (or that shares no more than a
   tenth of the prompt: ``ram_cache.SIMILARITY``) makes the server load the
   entry that beats the slot's own content, so a session parked there is predicted to come
   back whole (``RamView``, ``candidate``); the load is counted on only when the slot keeps
   under 0.4 of its content (``ram_cache.SURE_CONSULT``: the shares are estimates), and an
   entry serving the prompt as far as the slot's content does, by segments, counts as loaded
   (the server's exact tokens may favour it; ``ram_cache.pick``'s ``ties``). Where the slot
   keeps more (another session under the same long system prompt) and the cache holds the
   request's own conversation, a *primer* sent first (``ram_cache.PRIMER``) makes the server
   park the slot's content and load that entry: the candidate is ``primed`` when that serves
   more than the slot's own content by more than the primer's ``PRIMER_TOKENS``, which it
   costs (never another session's entry, which loading would destroy; not with unified KV,
   which clears an idle slot at the next task; not under cache isolation: ``prime``).
2. *Disk*: a snapshot of a prefix of the request restorable on the backend (``Offer`` from
   ``core.disk.snapshots``) serves its tokens in any idle slot, at the restore's cost in
   prefill-token equivalents; the candidate restores when that nets more than the slot's
   own reuse.
3. *Eviction damage* of s, weighted by the odds that its session is back for it: on a backend
   that cannot bring overwritten content back itself (``exact``, or no RAM cache), the measured
   odds (``core.routing.return_odds``: content whose session is due back soon outweighs fresher
   content whose session is due back later); else, and before any return was measured, the
   prior ``0.5 ** (age / value_half_life_s)``. When the request continues s's conversation
   (the shared prefix reaches s's first user message, ``Fingerprint.same_conversation``),
   only the tail it overwrites (s's tokens beyond the shared prefix); otherwise s's whole
   content, since that conversation loses its slot: its whole KV, which for a raw prompt
   holds its reply too (``kv_estimate``; a chat content's estimate already does: a short
   question with a long reply is not a cheap slot).
   Content of another conversation evicted on a backend with the RAM cache, by a request
   that keeps less than half of it, is parked there rather than lost (and comes back the
   same way), so its damage is scaled by ``ram_discount``. A RAM entry the server would load
   for the request is moved out of the cache and overwritten beyond what it shares: its
   loss (the same rule, weighted by when it was parked) is damage too, so a request sharing
   only a header with a parked session takes a slot that does not make the server load it.
   *Score* = reuse - restore cost - ``eviction_weight`` * damage. So a continuing session
   scores its whole history, while a new session that shares only the system prompt with
   another session's slot prefers restoring it from disk into an empty or stale slot, or
   re-prefilling it there, to taking that slot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple

from proxy.core.disk.snapshots import Offer
from proxy.core.prompt.fingerprint import Fingerprint, common_segments, shared_tokens
from proxy.core.routing.index import BackendIndex
from proxy.core.routing.return_odds import ReturnOdds
from proxy.core.server import ram_cache
from proxy.core.server.fleet import BackendState, SlotPhase, SlotState
from proxy.core.server.ram_cache import PRIMER_TOKENS, RamEntry
from proxy.core.server.reuse_rules import checkpoint_reuse
from proxy.core.server.slots import kv_length


@dataclass(frozen=True)
class RoutingParams:
    min_prefix_tokens: int = 16
    wait_min_tokens: int = 1024
    wait_min_fraction: float = 0.5  # ... or this share of the prompt, if smaller
    # damage counts as the tokens it costs, the unit of reuse (not a setting: 1 is the
    # objective's own scale; 0 lost hit rate on every replay row, bench.ablation)
    eviction_weight: float = 1.0
    value_half_life_s: float = 600.0
    ram_discount: float = 0.1  # eviction damage when the evicted content stays in host RAM
    # the measured odds that a slot's content is used again (``core.routing.return_odds``); None
    # before any session came back: the half-life prior
    returns: ReturnOdds | None = None
    # a primer may make the server load a session's parked content (``Fleet.primes``: off under
    # cache isolation and with slots not pinned; off for a request that reuses nothing)
    prime: bool = True

    def __post_init__(self) -> None:
        # a loss that counts as a gain has no upper bound (``kin_bound``), and means nothing
        if self.eviction_weight < 0:
            raise ValueError(f"eviction_weight {self.eviction_weight}: must be at least 0")


@dataclass(frozen=True)
class Candidate:
    backend: BackendState
    slot: SlotState
    reuse: int
    score: float
    load: int  # busy slots of the backend when the decision was made
    restore: Offer | None = None  # restore this snapshot into the slot first
    from_ram: RamEntry | None = None  # the RAM-cache entry the server will load into the slot
    extends: bool = False  # the prompt extends all of what it reuses: a session continuing
    primed: bool = False  # a primer first makes the server load ``from_ram`` (``PRIMER_TOKENS``)


@dataclass(frozen=True)
class RamView:
    """A backend's RAM-cache entries as one request sees them, oldest first."""

    prompt_tokens: int = 0
    entries: Sequence[RamEntry] = ()  # the backend's list itself: compared by identity
    served: tuple[tuple[int, int], ...] = ()  # (tokens it serves the prompt, its length)
    shared: tuple[int, ...] = ()  # segments each entry shares with the request
    scale: float = 1.0  # the backend's tokens per estimate when ``served`` was measured
    loadable: tuple[int, ...] = ()  # the entries serving the prompt a token, in order
    owned: bool = False  # one of them holds the request's own conversation (``own``)
    # (backend version, ``index.BackendIndex.holds`` as of it): whether a slot holds a chain
    holds: tuple[int, Callable[[tuple[int, ...]], bool]] | None = None

    def pick(self, kept: int, content_tokens: int, skip: int = 0, ties: bool = False) -> int | None:
        """``ram_cache.pick`` over the entries but the ``skip`` oldest: only the loadable
        ones are read (the server never loads an entry serving nothing)."""
        at = [i for i in self.loadable if i >= skip] if skip else self.loadable
        found = ram_cache.pick(
            [self.served[i] for i in at], kept, content_tokens, self.prompt_tokens, ties
        )
        return at[found] if found is not None else None

    def own(self, index: int) -> bool:
        """Whether entry ``index`` holds the request's own conversation (the prompt shares it
        past its anchor: a session's parked content, not another's under the same system
        prompt)."""
        return self.entries[index].content.same_conversation(self.shared[index])

    @cached_property
    def best(self) -> int:
        """What the cache gives the request in a slot that holds nothing it shares."""
        index = self.pick(0, 0)
        return self.served[index][0] if index is not None else 0

    def damage(self, index: int, now: float, params: RoutingParams, backend: BackendState) -> float:
        """Recency-weighted loss if the request loads (and so overwrites) entry ``index``;
        computed only for the entry a candidate would load (most entries are never picked),
        against what the backend's slots hold at this decision."""
        entry = self.entries[index]
        # a copy of what a slot holds loses nothing when it leaves the cache
        if self.holds is not None and self.holds[0] == backend.version:
            if self.holds[1](entry.content.hashes):
                return 0.0
        else:
            resident = (s.expected for s in backend.slots if s.expected is not None)
            if any(ram_cache.covers(r, entry.content) for r in resident):
                return 0.0
        served, length = self.served[index]
        lost = lost_tokens(entry.content, self.shared[index], served, length)
        return lost * _recency(entry.at, now, params)


UNSHARED = (0, 0)  # a RAM entry the request shares less than a quarter of (never loaded)


def shared_segments(fp: Fingerprint, content: Fingerprint | None) -> int:
    return common_segments(fp.hashes, content.hashes) if content is not None else 0


def _reuse(fp: Fingerprint, content: Fingerprint, exact: bool, shared: int | None = None) -> int:
    """What ``content`` serves ``fp``: up to where they part (into the parting segment:
    ``shared_tokens``), or on an ``exact`` backend up to a checkpoint."""
    shared = shared_segments(fp, content) if shared is None else shared
    if exact and (shared < len(content.hashes) or shared == len(fp.hashes)):
        shared = checkpoint_reuse(content.users, min(shared, len(fp.hashes) - 1))
        return max(0, min(fp.tokens_at(shared), fp.total - 1))
    return max(0, min(shared_tokens(fp, content, shared), fp.total - 1))


def predicted_reuse(fp: Fingerprint, slot: SlotState, exact: bool, parked: int = 0) -> int:
    """Tokens the server will reuse if the request is pinned to ``slot``.

    Besides the slot's own content, llama-server's RAM prompt cache (``parked``: the best
    reuse any entry parked there offers, ``ram_reuse``) is consulted when the pinned slot
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


def recency(slot: SlotState, now: float, params: RoutingParams, backend: BackendState) -> float:
    """The weight of what ``slot`` holds: where the server cannot bring content back itself
    once it is overwritten (an ``exact`` backend, or one without the RAM cache), the measured
    odds that its session is back for it (``core.routing.return_odds``); else, and before any return
    was measured, the half-life prior."""
    returns = params.returns
    if returns is not None and (backend.exact or not backend.ram):
        return returns.weight(max(0.0, now - slot.last_used))
    return _recency(slot.last_used, now, params)


def weigher(now: float, params: RoutingParams, backend: BackendState) -> Callable[[float], float]:
    """``recency`` on ``backend`` at ``now`` as a function of a slot's last use (one lookup
    of the rule per backend, for a loop over its slots)."""
    returns = params.returns
    if returns is not None and (backend.exact or not backend.ram):
        return lambda last_used: returns.weight(max(0.0, now - last_used))
    return lambda last_used: _recency(last_used, now, params)


def _recency(last_used: float, now: float, params: RoutingParams) -> float:
    age = max(0.0, now - last_used)
    return float(0.5 ** (age / params.value_half_life_s))


def lost_tokens(content: Fingerprint, shared: int, reuse: int, length: int) -> int:
    """Tokens of ``content`` (``length`` in the KV: a raw prompt's holds its reply too) a
    request reusing ``reuse`` of it overwrites: the tail of the prompt when it continues that
    conversation, else the whole KV (that conversation loses its copy)."""
    if reuse and content.same_conversation(shared):
        return max(0, content.total - reuse)
    return max(content.total, length)


def ram_view(
    fp: Fingerprint,
    backend: BackendState,
    before: RamView | None = None,
    heads: Mapping[tuple[int, int], Sequence[int]] | None = None,
    holds: Callable[[tuple[int, ...]], bool] | None = None,
) -> RamView:
    """``before``: this request's last view of the backend, reused while its cache is the
    same list (``BackendState.ram_entries`` is replaced, never changed in place) and its token
    scale the same (a sealed entry's length is measured through it): a request that waits is
    decided again on every release, and the cache rarely changed in between. ``heads``: the
    entries by the head of their content (``index.BackendIndex.ram_heads``): an entry that
    serves the prompt a token shares its head, so only those are compared. ``holds``:
    whether the backend's slots hold a chain (``index.BackendIndex.holds``), as of its
    current version."""
    entries = backend.ram_entries
    if not backend.ram or not fp.total or not entries:
        return RamView(fp.total)
    scale = backend.token_scale or 1.0
    known = None if holds is None else (backend.version, holds)
    if before is not None and before.entries is entries and before.scale == scale:
        if known is None or before.holds == known:
            return before
        return replace(before, holds=known)  # (the slots changed since)
    if heads is None:
        at: Sequence[int] = range(len(entries))
    else:
        at = heads.get(fp.head, ()) if fp.head is not None else ()
    # most entries share under a quarter with the request (``shared`` 0): never loaded, so
    # their length is not worked out (``UNSHARED``); the length is the real KV's, as for a
    # slot's own content (``candidate``), whatever the model
    served, shared = [UNSHARED] * len(entries), [0] * len(entries)
    loadable, owned = [], False
    tokens, cap, exact = fp.tokens, fp.total - 1, backend.exact
    for i, n in zip(at, ram_cache.shared_segments(fp, [entries[i] for i in at]), strict=True):
        if not n:
            continue
        entry = entries[i]
        # (_reuse without the exact rule, inlined for the usual model: into the segment
        # where they part, by its pieces, as the server compares tokens)
        if exact:
            reuse = _reuse(fp, entry.content, True, n)
        elif fp.parts:
            reuse = min(shared_tokens(fp, entry.content, n), cap)
        else:
            reuse = min(tokens[n - 1], cap)
        served[i], shared[i] = (reuse, kv_length(entry.content, entry.size, scale)), n
        if reuse > 0:
            loadable.append(i)
            owned = owned or entry.content.same_conversation(n)
    return RamView(
        fp.total, entries, tuple(served), tuple(shared), scale, tuple(loadable), owned, known
    )


class RamViews:
    """Each ready backend's ``ram_view`` of one request, worked out when first read (and
    kept in ``memo``, the request's views from its earlier decisions); ``most``: at most
    what any of a backend's entries serves the request, read from its index without a view
    (``index.BackendIndex.ram_most``). A decision reads the views of the backends whose
    entries may serve the request more than what it weighs them against: a returning
    session's own slot outscores every entry of another conversation, so it reads none of
    theirs. ``backends``: the fleet's, by index; ``ready``: those the decision reads."""

    def __init__(
        self,
        fp: Fingerprint,
        backends: Sequence[BackendState],
        ready: Sequence[BackendState],
        indexes: Mapping[int, BackendIndex],
        memo: dict[int, RamView] | None = None,
    ) -> None:
        self._fp, self._backends, self._indexes = fp, backends, indexes
        self._memo = memo if memo is not None else {}
        self._views: dict[int, RamView] = {}  # read in this decision
        self.empty = RamView(fp.total)  # the view of every backend without entries
        # the backends that may load an entry, and their ``most`` once read (-1 before)
        self.loading = {b.index: -1 for b in ready if b.ram and b.ram_entries}

    def __getitem__(self, index: int) -> RamView:
        if index not in self.loading:
            return self.empty
        view = self._views.get(index)
        if view is None:
            backend, grouped = self._backends[index], self._indexes[index]
            before = self._memo.get(index)
            view = ram_view(self._fp, backend, before, grouped.ram_heads, grouped.holds)
            self._views[index] = self._memo[index] = view
        return view

    def may_load(self, index: int) -> bool:
        """Whether an entry of the backend may serve the request a token (one sharing its
        head: cheaper than ``most``)."""
        head = self._fp.head
        return index in self.loading and head is not None and head in self._indexes[index].ram_heads

    def most(self, index: int) -> int:
        found = self.loading.get(index, 0)
        if found < 0:
            found = self.loading[index] = self._indexes[index].ram_most(self._fp)
        return found


def candidate(
    fp: Fingerprint,
    backend: BackendState,
    slot: SlotState,
    now: float,
    params: RoutingParams,
    ram: RamView | None = None,
    load: int = 0,
    offer: Offer | None = None,
) -> Candidate:
    content = slot.content  # an idle slot: what its KV holds
    live, direct, shared, consulted, from_ram, destroyed = 0, 0, 0, False, None, 0.0
    length, primed = 0, False
    if content is not None and fp.hashes:
        shared = shared_segments(fp, content)
        live = direct = _reuse(fp, content, backend.exact, shared)
        length = backend.kv_estimate(content, slot.n_tokens)
        consulted = backend.ram and ram_cache.consulted(live, length, fp.total)
        surely = consulted and ram_cache.consulted(live, length, fp.total, ram_cache.SURE_CONSULT)
        primes = not surely and ram is not None and ram.owned and params.prime and backend.primable
        if ram is not None and (surely or primes):
            skip = 0  # saving the slot first pushes out the oldest entries only under a budget
            if backend.ram_tokens is not None:
                saved = backend.ram_entry(content, now, slot.n_tokens)
                # (primed: the request's own hook saves the primer too, before it loads)
                room = backend.ram_tokens - (0 if surely else PRIMER_TOKENS)
                skip = ram_cache.evicted_by(ram.entries, saved, room)
            if surely:
                i = ram.pick(live, length, skip, ties=True)
            else:  # the slot would hold the primer, of which the prompt keeps nothing
                i = ram.pick(0, PRIMER_TOKENS, skip)
                if i is not None and (not ram.own(i) or ram.served[i][0] - PRIMER_TOKENS <= live):
                    i = None  # (only a session's own parked content is worth a primer)
            if i is not None:
                live, from_ram, primed = ram.served[i][0], ram.entries[i], not surely
                destroyed = ram.damage(i, now, params, backend)
                consulted = True  # (primed: the primer's own hook parks the slot's content)
    spent = PRIMER_TOKENS if primed else 0
    restore = offer if offer is not None and offer.reuse - offer.cost > live - spent else None
    if restore is not None:
        reuse, gain, primed = restore.reuse, restore.reuse - restore.cost, False
    else:
        reuse, gain = live, live - spent
    if content is None or not fp.hashes:
        return Candidate(backend, slot, reuse, gain, load, restore)
    if restore is not None:
        consulted, from_ram, destroyed = backend.ram, None, 0.0
    ours = content.same_conversation(shared)
    # Another conversation's content is parked in host RAM, and can come back later, only
    # when this request makes the server consult its cache (``ram_cache.consulted``), and
    # so is any content a RAM load displaces; an entry the server loads for this request is
    # overwritten beyond what it shares.
    discount = params.ram_discount if consulted and (not ours or from_ram is not None) else 1.0
    # what the slot's own content loses is judged by what the request shares with *it*, not
    # by tokens a RAM entry or a snapshot brings into the slot
    lost = lost_tokens(content, shared, direct, length)
    damage = lost * recency(slot, now, params, backend) * discount + destroyed
    score = gain - params.eviction_weight * damage
    extends = restore is None and reuse > 0 and _extends(fp, content, shared, from_ram)
    return Candidate(backend, slot, reuse, score, load, restore, from_ram, extends, primed)


class KinCeiling(NamedTuple):
    """What bounds a kin slot's score on one backend (kin: a slot sharing a token with the
    prompt but not its anchor: another conversation's, under the same system prompt). (A
    tuple: one per backend per decision, made fast.)"""

    gain: float  # the most it gains: the prompt before its conversation, a RAM load, a restore
    before: int  # the most it reuses of its own: the prompt before its conversation
    floor: int  # the least it reuses of its own (the prompt's first segment holding tokens)
    restored: float | None  # what restoring a snapshot into it nets (None: no snapshot)
    # the RAM entries the server may load into it, each as (tokens it serves, what loading it
    # destroys); None: not worked out, a load counts as ``gain`` with nothing destroyed
    loads: tuple[tuple[int, float], ...] | None = None

    # a RAM load is certain for a slot holding anything: only a restore netting more avoids it
    forced: bool = False
    # a primer may load the request's own parked session into a slot whatever it keeps of it
    # (``candidate``), whose content the primer's hook then parks
    primes: bool = False


def kin_reach(fp: Fingerprint) -> tuple[int, int]:
    """Per request, what bounds a kin slot's own reuse: at most the prompt before its
    conversation (before the anchor), and, on a model that reuses any prefix, at least the
    prompt's first segment holding tokens (the kin share it)."""
    cap = fp.total - 1
    before = max(0, min(fp.tokens_at(fp.anchor - 1), cap))
    return before, max(0, min(fp.tokens_at(fp.first + 1), cap))


def kin_ceiling(
    reach: tuple[int, int], backend: BackendState, ram: RamView, offer: Offer | None
) -> KinCeiling:
    """``KinCeiling`` on ``backend`` (``reach``: ``kin_reach`` of the request): a kin slot's
    own reuse ends before the prompt's anchor, a RAM entry loaded into it serves at most the
    best entry, a restore nets its gain; an exact model may keep none of it."""
    before, floor = reach
    parked = max(ram.served[i][0] for i in ram.loadable) if ram.loadable else 0
    restored = offer.reuse - offer.cost if offer is not None else None
    gain = max(before, parked, restored or 0)
    loads = None if ram.loadable else ()  # (no entry to load: nothing to work out)
    return KinCeiling(gain, before, 0 if backend.exact else floor, restored, loads)


def kin_loads(
    ceiling: KinCeiling, ram: RamView, now: float, params: RoutingParams, backend: BackendState
) -> KinCeiling:
    """``ceiling`` with the RAM entries a load may bring worked out: an entry the server
    loads is destroyed beyond what it shares (``RamView.damage``), so a load nets less than
    the tokens it serves (a new session sharing only the system prompt with every parked
    session of the fleet gains that prompt and loses one of them). Of the entries, those
    that no other serves as much or more of the prompt for no greater loss: the bound of
    each slot takes the best of them against its own damage, in ``candidate``'s order of
    operations (so it holds in floating point too)."""
    loads: list[tuple[int, float]] = []
    least = math.inf
    for i in sorted(ram.loadable, key=lambda i: ram.served[i][0], reverse=True):
        destroyed = ram.damage(i, now, params, backend)
        if destroyed < least:  # (else one serving as much destroys no more: it bounds this)
            loads.append((ram.served[i][0], destroyed))
            least = destroyed
    primes = ram.owned and params.prime and backend.primable
    return ceiling._replace(loads=tuple(loads), primes=primes)


def stranger_ceiling(
    ceiling: KinCeiling, ram: RamView, now: float, params: RoutingParams, backend: BackendState
) -> KinCeiling:
    """``ceiling`` (``kin_loads``' worked out) for a slot sharing no token with the prompt (a
    spare stranger): it reuses nothing of its own, so the server may park all of it. With no
    RAM budget the server loads into every such slot that holds anything the same entry, the
    one that beats keeping nothing: its tokens less what loading it destroys are all it gains,
    unless a restore nets more."""
    bare = ceiling._replace(before=0, floor=0)
    if ceiling.loads is None or backend.ram_tokens is not None or not ram.loadable:
        return bare
    i = ram.pick(0, 1, ties=True)
    if i is None:
        return bare._replace(loads=())
    load = (ram.served[i][0], ram.damage(i, now, params, backend))
    return bare._replace(loads=(load,), forced=True)


def stranger_most(bare: KinCeiling, params: RoutingParams, hollow: bool) -> float:
    """The most a slot sharing no token with the prompt can score (``kin_bound`` with
    ``bare``, its ``stranger_ceiling``, is no higher for any such slot of the backend): what a
    restore nets, or an entry's tokens less what loading it destroys, or, where a load is not
    certain or a slot holds no token (``hollow``: an empty slot loads nothing), nothing;
    ``inf`` when ``bare.loads`` is not worked out."""
    if bare.loads is None:
        return math.inf
    if bare.forced and not hollow:
        most = -math.inf if bare.restored is None else bare.restored
    else:
        most = float(max(0, bare.restored or 0))
    for served, destroyed in bare.loads:
        most = max(most, served - params.eviction_weight * destroyed)
    return most


def kin_bound(
    fp: Fingerprint,
    backend: BackendState,
    slot: SlotState,
    now: float,
    params: RoutingParams,
    ceiling: KinCeiling,
) -> float:
    """An upper bound on ``candidate``'s score for a kin slot: its gain is at most
    ``ceiling.gain`` (with ``ceiling.loads``: its own reuse or a restore, or an entry's tokens
    less what loading it destroys), and it loses at least what ``candidate``
    counts with the RAM discount applied wherever the server may park its content (a restore
    into it, or a request that may keep under half of it: not when even ``ceiling.floor`` is
    half). It shares less than the prompt's anchor, so less than its own when that is no
    earlier: its content is lost whole; else at least what lies beyond the prompt before its
    conversation. Computed in ``candidate``'s order of operations, so the bound holds in
    floating point too (rounding is monotone)."""
    content = slot.content
    if content is None:  # an empty slot loses nothing, and an empty pinned slot loads nothing
        return ceiling.gain if ceiling.loads is None else max(0, ceiling.restored or 0)
    length = backend.kv_estimate(content, slot.n_tokens)
    # what it gains without a RAM load: its own reuse, or a restore
    if ceiling.forced and length > 0:
        plain = -math.inf if ceiling.restored is None else ceiling.restored
    else:
        plain = max(ceiling.before, ceiling.restored or 0)
    if content.anchor >= fp.anchor:
        lost = max(content.total, length)
    else:
        lost = max(0, content.total - ceiling.before)
    restorable = ceiling.restored is not None
    primes = ceiling.primes or ceiling.loads is None
    parks = backend.ram and (
        restorable or primes or ram_cache.consulted(ceiling.floor, length, fp.total)
    )
    discount = min(params.ram_discount, 1.0) if parks else 1.0
    damage = lost * recency(slot, now, params, backend) * discount
    w = params.eviction_weight
    if ceiling.loads is None:
        return ceiling.gain - w * damage
    bound = plain - w * damage
    for served, destroyed in ceiling.loads:
        bound = max(bound, served - w * (damage + destroyed))
    return bound


def _extends(fp: Fingerprint, own: Fingerprint, shared: int, loaded: RamEntry | None) -> bool:
    """The prompt continues all of what the slot will hold: the RAM entry it loads, else its
    own content (``shared``: the segments the prompt shares with that, already counted)."""
    if loaded is None:
        return shared == len(own.hashes)
    return shared_segments(fp, loaded.content) == len(loaded.content.hashes)


def once_done(slot: SlotState, now: float) -> SlotState:
    """A busy ``slot`` as it will be, idle, once its request is done: scoring it tells what
    waiting for it is worth (``core.routing.waiting``)."""
    return replace(slot, phase=SlotPhase.IDLE, content=slot.expected, last_used=now)


def ram_reuse(fp: Fingerprint, backend: BackendState) -> int:
    """What the backend's RAM prompt cache would restore for this request into a slot that
    holds nothing it shares (``core.server.ram_cache.pick``)."""
    return ram_view(fp, backend).best

"""A backend's slots grouped for routing, kept across decisions while the backend is unchanged.

A decision reads, per backend, its idle slots, the ones among them that share a token with
the prompt, the busy ones that will, the ones a session just left, and the stranger that
costs least to overwrite. Scanning every slot of every backend for each of these makes a
decision cost in proportion to the fleet. ``FleetIndex`` keeps per backend a
``BackendIndex``, rebuilt only when the backend changed (``BackendState.version``: any write
to it or to one of its slots bumps it), so a decision costs per backend a version compare
and a few dictionary lookups, plus the slots that share the prompt:

- *Heads*: a slot shares a token with a prompt exactly when their *heads* are equal: the
  first segment holding tokens and its chain hash (hash ``i`` of a chain covers segments
  ``0..i``, and equal segments carry equal token estimates). Idle slots are grouped by the
  head of what they hold, busy ones by the head of what they will hold.
- *Recent*: the idle slots holding content, most recently used first: a hold
  (``core.routing.returns``) can only keep such a slot used within the last ``hold`` seconds,
  so the check stops at the first older one.
- *Strangers by loss*: overwriting a stranger (a slot sharing no token) costs its KV length
  ``L`` times its recency weight times the RAM discount ``d`` (``options.strangers``). Under
  the half-life prior the weight is ``0.5 ** ((now - last_used) / half_life)``, so the
  order of the losses does not depend on ``now``: it is the order of
  ``log(L * d) + last_used * ln 2 / half_life``, kept sorted per backend once a second
  decision reads the same grouping (the first ranks its strangers directly: a backend that
  changes at every request never repays the sort). A decision walks it
  past the slots sharing the prompt (and held ones) and ranks exactly only the first few,
  those within a rounding margin of the first (``STRANGER_MARGIN``). Where the prior does
  not hold (the measured return odds, which are not monotone in age; a slot used after
  ``now``; a prompt or contents that make the discount depend on the prompt) the caller
  ranks every stranger instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cached_property

from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.server.fleet import BackendState, SlotPhase, SlotState
from proxy.core.server.slots import kv_length

Head = tuple[int, int]  # (first segment holding tokens, its chain hash)
# a head's RAM entries: the most segments one holds, the most one holds that is anchored
# nowhere in it, and per conversation (its anchor and the hash there) the most one holds
RamSpans = tuple[int, int, dict[tuple[int, int], int]]
STRANGER_MARGIN = 1e-9  # relative: log losses this close to the least are ranked exactly


def head(fp: Fingerprint | None) -> Head | None:
    """The chain's first segment holding tokens and its hash; None when it holds none."""
    return fp.head if fp is not None else None


def continues(fp: Fingerprint, content: Fingerprint | None) -> bool:
    """Whether ``content`` (sharing the prompt's head) may hold the prompt's conversation: it
    shares the segments up to the prompt's anchor too (one hash compare; any content when the
    prompt has no anchor). One that does not (kin: another conversation under the same
    system prompt) reuses at most the prompt before its anchor (``scoring.kin_reach``)."""
    at = fp.anchor - 1
    if at < 0:
        return True
    hashes = content.hashes if content is not None else ()
    return len(hashes) > at and hashes[at] == fp.hashes[at]


class BackendIndex:
    """One backend's slots grouped (module docstring), as of ``version``: its idle slots in
    one pass over the slots, the rest when first read (a backend that changes at every
    request, as a lone backend does, is grouped at every decision: only what that decision
    reads is worked out)."""

    def __init__(self, backend: BackendState) -> None:
        self.backend, self.version = backend, backend.version
        idle = SlotPhase.IDLE
        self.idle = [s for s in backend.slots if s.phase is idle]
        self._reads = 0  # lookups by head so far (``sharing``)
        # (half-life, RAM discount) -> the idle slots holding content by log loss
        self._orders: dict[tuple[float, float], list[tuple[float, float, int, SlotState]]] = {}
        self._held: dict[int, frozenset[int]] = {}  # chain length -> the slots' hashes there
        self._loss_reads: set[tuple[float, float]] = set()  # ``kept_by_loss`` asked once
        # (half-life, RAM discount, count) -> ``least_lost`` skipping no slot
        self._cheapest: dict[tuple[float, float, int], tuple[float, list[SlotState]]] = {}

    def sharing(self, key: Head) -> list[SlotState]:
        """The idle slots whose content has head ``key``, in slot order. The first lookup
        filters the idle slots; a second one groups them all by head (``idle_heads``): a
        backend that changes at every request is read once per grouping."""
        if "idle_heads" not in self.__dict__ and self._reads == 0:
            self._reads = 1
            return [s for s in self.idle if s.content is not None and s.content.head == key]
        return self.idle_heads.get(key, [])

    @cached_property
    def busy(self) -> list[SlotState]:
        """Every slot not IDLE, in slot order."""
        idle = SlotPhase.IDLE
        return [s for s in self.backend.slots if s.phase is not idle]

    def waiting(self, key: Head) -> list[SlotState]:
        """The busy slots that will hold content with head ``key``, in slot order."""
        return self.busy_heads.get(key, [])

    @cached_property
    def idle_heads(self) -> dict[Head, list[SlotState]]:
        """Idle slots by the head of their content."""
        out: dict[Head, list[SlotState]] = {}
        for slot in self.idle:
            content = slot.content
            if content is not None and content.head is not None:
                out.setdefault(content.head, []).append(slot)
        return out

    @cached_property
    def busy_heads(self) -> dict[Head, list[SlotState]]:
        """Busy slots by the head of what they will hold."""
        out: dict[Head, list[SlotState]] = {}
        for slot in self.busy:
            key = head(slot.expected)
            if key is not None:
                out.setdefault(key, []).append(slot)
        return out

    @cached_property
    def recent(self) -> list[SlotState]:
        """The idle slots holding content (a hold keeps no empty slot), the most recently
        used first."""
        held = (s for s in self.idle if s.content is not None)
        return sorted(held, key=lambda s: (-s.last_used, s.id))

    @cached_property
    def empty(self) -> list[SlotState]:
        """The idle slots holding nothing, the least recently used first."""
        return sorted(
            (s for s in self.idle if s.content is None), key=lambda s: (s.last_used, s.id)
        )

    @cached_property
    def mixed(self) -> bool:
        """Whether the idle slots hold both raw prompts' contents (no anchor) and chat
        prompts' (``options._cheapest``)."""
        anchors = [s.content.anchor for s in self.idle if s.content is not None]
        return 0 in anchors and any(anchors)

    @cached_property
    def hollow(self) -> bool:
        """Whether an idle slot may hold no token: empty, or a content whose estimate holds
        none (the server may load no RAM entry into it: ``scoring.stranger_most`` then
        counts what taking a slot nets without one)."""
        return any(s.content is None or not s.content.total for s in self.idle)

    @cached_property
    def latest(self) -> float:
        """The latest use of an idle slot holding content."""
        return max((s.last_used for s in self.idle if s.content is not None), default=-math.inf)

    @cached_property
    def anchored(self) -> int:
        """The smallest anchor above 0 of an idle slot's content (0: none)."""
        anchors = (s.content.anchor for s in self.idle if s.content is not None)
        return min((a for a in anchors if a), default=0)

    @cached_property
    def ram_heads(self) -> dict[Head, list[int]]:
        """The backend's RAM entries (positions, oldest first) by the head of their content:
        an entry serving a prompt a token shares its head (``scoring.ram_view``)."""
        return self._ram_groups[0]

    @cached_property
    def _ram_groups(self) -> tuple[dict[Head, list[int]], dict[Head, RamSpans]]:
        heads: dict[Head, list[int]] = {}
        spans: dict[Head, RamSpans] = {}
        for i, entry in enumerate(self.backend.ram_entries):
            content = entry.content
            key = content.head
            if key is None:
                continue
            heads.setdefault(key, []).append(i)
            n, anchor = len(content.hashes), content.anchor
            longest, loose, conversations = spans.get(key, (0, 0, {}))
            if 0 < anchor <= n:
                at = (anchor, content.hashes[anchor - 1])
                conversations[at] = max(conversations.get(at, 0), n)
            else:
                loose = max(loose, n)
            spans[key] = (max(longest, n), loose, conversations)
        return heads, spans

    def ram_most(self, fp: Fingerprint) -> int:
        """At most the tokens any of the backend's RAM entries serves ``fp``
        (``scoring.ram_view``), read without comparing the prompt with any entry: one serving
        a token shares its head, and shares at most as many segments as it holds. Where the
        prompt's anchor is a user message, an entry sharing that many segments shares it, so
        it is of the same conversation, anchored there (the segments before it are the same
        system messages): any other entry serves at most the prompt before its
        conversation."""
        spans = self._ram_groups[1].get(fp.head) if fp.head is not None else None
        if spans is None:
            return 0
        longest, loose, conversations = spans
        size, anchor = len(fp.hashes), fp.anchor
        if fp.users and fp.users[0] == anchor - 1:
            own = conversations.get((anchor, fp.hashes[anchor - 1]), 0)
            n = max(min(anchor - 1, longest), min(size, max(own, loose)))
        else:
            n = min(size, longest)
        return max(0, min(fp.tokens_at(n), fp.total - 1))

    def holds(self, hashes: tuple[int, ...]) -> bool:
        """Whether one of the backend's slots holds or will hold content of which the chain
        ``hashes`` is a prefix (``ram_cache.covers``: a RAM entry that is a copy of it). Per
        chain length, the slots' hashes at that length are collected on first use."""
        n = len(hashes)
        held = self._held.get(n)
        if held is None:
            contents = [s.expected for s in self.backend.slots if s.expected is not None]
            if n:
                held = frozenset(c.hashes[n - 1] for c in contents if len(c.hashes) >= n)
            else:  # an empty chain is a prefix of any content
                held = frozenset([0] if contents else [])
            self._held[n] = held
        return (hashes[-1] if n else 0) in held

    def kept_by_loss(
        self, half_life: float, discount: float
    ) -> list[tuple[float, float, int, SlotState]] | None:
        """``by_loss``'s order from the second read of this index on; None at the first: the
        order pays for its sort only when a later decision reads it again (a backend that
        changes at every request, as a lone backend under load does, is read once per
        grouping), and the caller ranks the few slots it needs directly instead."""
        key = (half_life, discount)
        if key in self._orders:
            return self._orders[key]
        if key not in self._loss_reads:
            self._loss_reads.add(key)
            return None
        return self.by_loss(half_life, discount)

    def cheapest(
        self, half_life: float, discount: float, skip: frozenset[int], count: int = 1
    ) -> tuple[float, Sequence[SlotState]] | None:
        """``least_lost`` over ``kept_by_loss``'s order (None while it is not kept). With no
        slot to skip, as on most backends of a fleet (none of their slots shares the prompt),
        the answer is the grouping's own and kept with it."""
        order = self.kept_by_loss(half_life, discount)
        if order is None:
            return None
        if skip:
            return least_lost(order, skip, count)
        key = (half_life, discount, count)
        found = self._cheapest.get(key)
        if found is None:
            found = self._cheapest[key] = least_lost(order, skip, count)
        return found

    def by_loss(
        self, half_life: float, discount: float
    ) -> list[tuple[float, float, int, SlotState]]:
        """(log loss, last use, id, slot) of every idle slot holding content, ascending; a
        content without anchor (a raw prompt's) is not parked by a stranger's request."""
        key = (half_life, discount)
        order = self._orders.get(key)
        if order is None:
            backend = self.backend
            scale, order = backend.token_scale or 1.0, []
            for slot in self.idle:
                content = slot.content
                if content is None:
                    continue
                length = kv_length(content, slot.n_tokens, scale)
                parks = discount if backend.ram and length > 0 and content.anchor else 1.0
                loss = length * parks
                log = (
                    math.log(loss) + slot.last_used * math.log(2) / half_life if loss else -math.inf
                )
                order.append((log, slot.last_used, slot.id, slot))
            order.sort(key=lambda entry: entry[:3])
            self._orders[key] = order
        return order


def margin(log: float) -> float:
    """The highest log loss that may tie with ``log`` once rounded (``STRANGER_MARGIN``; a
    loss of 0, log -inf, ties only with losses of 0)."""
    return log + STRANGER_MARGIN * max(1.0, abs(log)) if math.isfinite(log) else log


def least_lost(
    order: Sequence[tuple[float, float, int, SlotState]], skip: frozenset[int], count: int = 1
) -> tuple[float, list[SlotState]]:
    """The least log loss of the slots of ``order`` (``BackendIndex.by_loss``) not in
    ``skip`` (slot ids), and the first ``count`` of those slots with every one within
    ``margin`` of the last of them: they include the ``count`` strangers that cost least to
    overwrite (``(inf, [])``: none left)."""
    rest, out = iter(order), list[SlotState]()
    for log, _, slot_id, slot in rest:  # the first ``count``
        if slot_id not in skip:
            out.append(slot)
            if len(out) == 1:
                least = log
            if len(out) == count:
                limit = margin(log)
                break
    else:
        return (least if out else math.inf), out
    for log, _, slot_id, slot in rest:  # and their ties
        if slot_id in skip:
            continue
        if log > limit:
            break
        out.append(slot)
    return least, out


class FleetIndex:
    """Each backend's ``BackendIndex``, rebuilt when the backend changed."""

    def __init__(self) -> None:
        self._backends: dict[int, BackendIndex] = {}

    def of(self, backend: BackendState) -> BackendIndex:
        kept = self._backends.get(backend.index)
        if kept is not None and kept.backend is backend and kept.version == backend.version:
            return kept
        built = self._backends[backend.index] = BackendIndex(backend)
        return built

"""How soon sessions come back after a response, and which freed slots to hold for them.

An agent sends its next turn as soon as its tool calls finish, often milliseconds to a
second after the reply; a person takes far longer. When a request takes the slot a session
has just left, that session's KV is overwritten, and when llama-server cannot park it in
host RAM (``--cache-ram 0``, or a cache too small for what its slots hold) the session
comes back to re-prefill its whole history. Holding the freed slot briefly keeps it, at the
cost of a wait for whoever would have taken it: worth it only if sessions do come back fast.

*Measuring* (``ReturnTracker``, independent of where requests were routed):

- ``released(prompt, content, now)``: a response ended. The last two hashes of the prompt's
  chain and the last of the content's (prompt + reply, as a chat client sends it back)
  identify what the session's next prompt will contain (two, because a raw prompt's last
  block is usually partial and a chat client may extend its last message); only hashes
  past the system prompt count, and a hash two waiting releases share names neither.
- ``arrived(fp, now)``: a request came. Scanning the last ``SCAN`` hashes of its chain from
  the end, the first registered one names the release it continues: a *return* after
  ``gap`` seconds. A release not continued within ``max_hold`` is a *miss* (slow or never).
- Several replicas (``shared``): a session's next request may reach another replica than the
  one that saw the release, so the shell also registers each release's hashes in the shared
  store and matches arrivals there (``returned``: a gap measured through the store, by wall
  clock); a release of this replica not continued within ``max_hold`` is a miss only if no
  replica claimed it, which the shell checks for the releases ``expired`` hands it
  (``missed``). Without this every replica would count its sessions' returns to the other
  replicas as misses, and hold nothing.
- ``hold(now)``: over the last ``WINDOW`` outcomes, when returns are at least half of them,
  twice the 90th percentile of the return gaps, at most ``max_hold`` (the shell passes
  ``max_slot_wait_seconds``: a hold is a wait for whoever would take the slot); otherwise 0
  (sessions come back too slowly for a hold to pay). Before any outcome, ``max_hold``:
  misses correct it within ``max_hold`` seconds.

*Holding* (``held``): an idle slot is held from requests of other conversations (a chat
request that does not share the content's first user message; a raw prompt that keeps less
than half of it) for ``hold`` seconds after its session left it, but never longer than twice
the time the backend would take to compute the content again (its real length, at the
measured prefill rate: an unheld session pays that recompute, and the slot it then takes
loses another session's content), when what it would overwrite is at least ``min_tokens``
and would be lost: the backend runs no RAM prompt cache, or a bounded one smaller than what
all its slots hold, in the server's tokens (whatever it parks now is pushed out before the
session is back). With an unbounded RAM cache nothing is held: the server parks the content
and loads it back (holding there anyway replayed worse). The holds' measurements, and a
fixed hold tried first: bench/HISTORY.md.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Sequence

from proxy.core.prompt.fingerprint import Fingerprint, common_segments
from proxy.core.routing.return_odds import HORIZON, ClaimRate, ReturnOdds, odds
from proxy.core.routing.return_odds import WINDOW as ODDS_WINDOW
from proxy.core.server.fleet import BackendState, SlotState

SCAN = 512  # hashes of an arriving chain searched for a release (8k tokens of raw blocks)
WINDOW = 128  # outcomes the hold is estimated from
PENDING = 4096  # releases awaiting their session, at most
AMBIGUOUS = 0  # release ids start at 1
# seconds between estimates of the return odds: they move with hundreds of outcomes, and
# building them (a sort of the window) per request cost more than the decision
REESTIMATE = 1.0


class ReturnTracker:
    """Return gaps of sessions, from releases and arrivals; ``now`` comes from the caller.

    A release is pending until its session is back or ``HORIZON`` passes; its outcome for
    the hold (a gap within ``max_hold``, else a miss) is decided by ``max_hold``, its outcome
    for the return odds (``core.routing.return_odds``: a gap, or gone) by ``HORIZON``."""

    def __init__(self, max_hold: float, *, shared: bool = False) -> None:
        self.max_hold = max_hold
        self._claims = ClaimRate()  # how often a slot is taken
        self.shared = shared
        self._expired: list[int] = []  # shared: releases past max_hold, claimed or not
        self._pending: OrderedDict[int, tuple[float, tuple[int, ...]]] = OrderedDict()
        self._open: OrderedDict[int, float] = OrderedDict()  # releases within max_hold
        self._keys: dict[int, int] = {}  # chain hash -> release id
        self._next = 0
        self._outcomes = Outcomes(WINDOW)  # the hold's: a gap, or None: a miss
        self._seen: deque[float | None] = deque(maxlen=ODDS_WINDOW)  # gap, or None: gone
        self._hold: float | None = None  # cached estimate; None: recompute
        self._odds: tuple[float, ReturnOdds | None] | None = None  # (when built, odds)

    def released(
        self, prompt: Fingerprint, content: Fingerprint, now: float
    ) -> tuple[int, tuple[int, ...]] | None:
        """Register a release; returns its id and the hashes that name it."""
        if not prompt.hashes:
            return None
        self._expire(now)
        if len(self._pending) >= PENDING:
            self._forget(next(iter(self._pending)), None)
        self._next += 1
        keys = _keys(prompt, content)
        self._pending[self._next] = (now, keys)
        if self.max_hold > 0:
            self._open[self._next] = now
        for key in keys:  # a prefix two pending sessions share names neither
            self._keys[key] = AMBIGUOUS if key in self._keys else self._next
        return (self._next, keys) if self.max_hold > 0 else None  # (the shared store's)

    def arrived(self, fp: Fingerprint, now: float) -> float | None:
        """The gap since the release this request continues, if any (and count it)."""
        self._expire(now)
        hashes = fp.hashes
        for i in range(len(hashes) - 1, max(-1, len(hashes) - 1 - SCAN), -1):
            release = self._keys.get(hashes[i], AMBIGUOUS)
            if release in self._pending:
                gap = now - self._pending[release][0]
                if release in self._open:
                    self._close(release, gap)
                self._forget(release, gap)
                return gap
        return None

    def returned(self, gap: float, release: int | None = None) -> None:
        """A return matched through the shared store; ``release``: when it was one of ours."""
        if release is not None and release in self._open:
            self._close(release, gap)
        else:
            self._outcomes.add(gap)
            self._hold = None
        if release is not None and release in self._pending:
            self._forget(release, gap)
        else:
            self._seen.append(gap)

    def expired(self) -> list[int]:
        """Shared: this replica's releases that expired since the last call."""
        found, self._expired = self._expired, []
        return found

    def missed(self, count: int) -> None:
        """Shared: ``count`` expired releases no replica claimed."""
        for _ in range(count):
            self._outcomes.add(None)
        if count:
            self._hold = None

    def hold(self, now: float) -> float:
        """How long a freed slot is held for its session now."""
        self._expire(now)
        if self._hold is None:
            self._hold = self._outcomes.estimate(self.max_hold)
        return self._hold

    def placed(self, now: float) -> None:
        """A request was placed on a slot (the claim rate)."""
        self._claims.placed(now)

    def odds(self, now: float, slots: int, mu: float | None = None) -> ReturnOdds | None:
        """The return odds now, at claim rate ``mu`` (default: the one measured over the
        fleet's ``slots``); None before any outcome."""
        if self._odds is None or now - self._odds[0] >= REESTIMATE or mu is not None:
            self._expire(now)
            mu = self._claims.rate(slots) if mu is None else mu
            self._odds = (now, odds(self._seen, mu))
        return self._odds[1]

    def _close(self, release: int, outcome: float | None) -> None:
        """The hold outcome of ``release``: a return within ``max_hold``, or a miss."""
        del self._open[release]
        if outcome is None and self.shared:
            self._expired.append(release)  # a miss unless another replica saw it come back
            return
        self._outcomes.add(outcome)
        self._hold = None

    def _forget(self, release: int, outcome: float | None) -> None:
        """The end of ``release``: its session is back after ``outcome`` s, or gone (None)."""
        _, keys = self._pending.pop(release)
        self._open.pop(release, None)
        for key in keys:
            if self._keys.get(key) in (release, AMBIGUOUS):
                del self._keys[key]
        self._seen.append(outcome)

    def _expire(self, now: float) -> None:
        while self._open:
            release, at = next(iter(self._open.items()))
            if now - at <= self.max_hold:
                break
            self._close(release, None)
        while self._pending:
            release, (at, _) = next(iter(self._pending.items()))
            if now - at <= HORIZON:
                return
            self._forget(release, None)


def _keys(prompt: Fingerprint, content: Fingerprint) -> tuple[int, ...]:
    """Hashes only this session's next prompt contains: the last two of the prompt and the
    last of the content, past the system prompt (a chain's anchor)."""
    start = max(prompt.anchor - 1, len(prompt.hashes) - 2, 0)
    tip = len(content.hashes) - 1
    return (*prompt.hashes[start:], *content.hashes[tip:][: int(tip >= start)])


def estimate(outcomes: Sequence[float | None], max_hold: float) -> float:
    """Twice the 90th-percentile return gap when at least half the outcomes are returns
    (capped at ``max_hold``); ``max_hold`` with no outcomes; else 0."""
    return _estimate(sorted(g for g in outcomes if g is not None), len(outcomes), max_hold)


def _estimate(gaps: Sequence[float], count: int, max_hold: float) -> float:
    """``estimate`` of ``count`` outcomes whose returns' gaps are ``gaps``, ascending."""
    if max_hold <= 0:
        return 0.0
    if not count:
        return max_hold
    if 2 * len(gaps) < count:
        return 0.0
    return min(max_hold, 2 * gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))])


class Outcomes:
    """The last ``size`` hold outcomes (a gap, or None: a miss), their gaps kept sorted as
    they come and go: the hold is estimated at every request without sorting the window."""

    def __init__(self, size: int) -> None:
        self._all: deque[float | None] = deque()
        self._gaps: list[float] = []
        self._size = size

    def add(self, outcome: float | None) -> None:
        if len(self._all) >= self._size:
            gone = self._all.popleft()
            if gone is not None:
                del self._gaps[bisect_left(self._gaps, gone)]
        self._all.append(outcome)
        if outcome is not None:
            insort(self._gaps, outcome)

    def estimate(self, max_hold: float) -> float:
        return _estimate(self._gaps, len(self._all), max_hold)


def lost_if_evicted(backend: BackendState) -> bool:
    """The backend cannot park an evicted slot's content until its session is back: no RAM
    prompt cache, or a bounded one smaller than what all its slots hold."""
    if not backend.ram:
        return True
    if backend.ram_tokens is None:
        return False
    held = sum(backend.kv_tokens(s.content, s.n_tokens) for s in backend.slots if s.content)
    return held > backend.ram_tokens


def held(
    backend: BackendState,
    slot: SlotState,
    fp: Fingerprint,
    now: float,
    hold: float,
    min_tokens: int,
) -> bool:
    """``slot`` (idle) is held for its session from the request ``fp``."""
    content = slot.content
    if content is None or hold <= 0 or now >= held_until(backend, slot, hold):
        return False  # most idle slots: not freed just now
    if not lost_if_evicted(backend):
        return False
    shared = common_segments(fp.hashes, content.hashes)
    reuse = fp.tokens_at(shared)
    # a chat request continues the conversation when it shares its first user message; a
    # raw prompt (no messages) when it keeps half of the content
    ours = content.same_conversation(shared) if content.anchor else 2 * reuse >= content.total
    return not ours and content.total - reuse >= min_tokens


def held_until(backend: BackendState, slot: SlotState, hold: float) -> float:
    """When ``slot``'s hold ends: never later than twice re-computing its content."""
    content = slot.content
    tokens = backend.kv_tokens(content, slot.n_tokens) if content is not None else 0
    return slot.last_used + min(hold, 2 * tokens / max(backend.prefill_tps, 1.0))

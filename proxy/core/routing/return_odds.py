"""The odds that a slot's content is used again: its session comes back, and finds it still there.

Overwriting what a slot holds costs its session a re-prefill only if the session comes back
before the slot would have been taken by another request anyway. Both halves are measured:

- *Return gaps* (``core.routing.returns``): the seconds between a response and its session's next
  request, over the last ``WINDOW`` releases, each either a gap or *gone* (no return within
  ``HORIZON``).
- *Claim rate* ``mu``: how often a given slot is taken by a request, per second (the fleet's
  placements per second over its slots, measured by the shell).

For content idle ``age`` seconds, among the recorded outcomes not over by then (gaps above
``age``, and the gone), the odds are the mean of ``exp(-mu * (gap - age))`` over them, a gone
one counting 0: the chance that the session is back, times the chance that no other request
took the slot in the meantime (claims as a Poisson process). So content whose session comes
back soon outweighs content whose session comes back late, even if the latter is fresher:
with three agent sessions cycling through two slots, a session's turn evicts the session
that just left (it is back last), not the one about to return, which is what an eviction by
least recent use does (and so it never finds its own slot again). Content older than every
recorded gap, with nothing recorded as gone, is not expected back: 0.

The sum over gaps above ``age`` is a suffix sum, kept relative to each gap so that it stays
finite for any ``mu`` and ``age``: a lookup is one bisection.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.core.server.slots import measured

HORIZON = 600.0  # seconds: a session not back within ten minutes is counted gone
WINDOW = 256  # outcomes the odds are estimated from


@dataclass(frozen=True)
class ReturnOdds:
    gaps: tuple[float, ...]  # recorded return gaps, ascending
    tails: tuple[float, ...]  # tails[k] = sum over j >= k of exp(-mu * (gaps[j] - gaps[k]))
    gone: int  # releases not followed within HORIZON
    mu: float  # claims per slot per second

    def weight(self, age: float) -> float:
        """The odds that content idle ``age`` seconds is used again by its session."""
        k = bisect_right(self.gaps, age)
        later = len(self.gaps) - k
        if later == 0:
            return 0.0
        reach = math.exp(-self.mu * (self.gaps[k] - age)) * self.tails[k]
        return reach / (later + self.gone)


def odds(outcomes: Sequence[float | None], mu: float) -> ReturnOdds | None:
    """The odds from ``outcomes`` (a gap, or None: gone) at claim rate ``mu``; None with no
    outcome recorded yet (the caller keeps its prior)."""
    if not outcomes:
        return None
    gaps = sorted(g for g in outcomes if g is not None)
    tails = [0.0] * len(gaps)
    run = 0.0
    for k in range(len(gaps) - 1, -1, -1):
        step = gaps[k + 1] - gaps[k] if k + 1 < len(gaps) else 0.0
        run = 1.0 + math.exp(-mu * step) * run
        tails[k] = run
    return ReturnOdds(tuple(gaps), tuple(tails), len(outcomes) - len(gaps), mu)


class ClaimRate:
    """``mu``: how often a given slot is taken, per second: one over the moving mean interval
    between placements (``slots.measured``) times the fleet's slots; 0 before two placements.
    Kept to two significant digits, so the odds are rebuilt only when it really changes."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._interval: float | None = None

    def placed(self, now: float) -> None:
        if self._last is not None:
            self._interval = measured(self._interval, max(0.0, now - self._last))
        self._last = now

    def rate(self, slots: int) -> float:
        if not self._interval:
            return 0.0
        return float(f"{1.0 / (self._interval * max(1, slots)):.2g}")

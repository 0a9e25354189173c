"""The odds that a slot's content is used again (``core.routing.return_odds``), and what routing
makes of them."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.routing.decision import route
from proxy.core.routing.return_odds import HORIZON, ClaimRate, odds
from proxy.core.routing.returns import ReturnTracker
from tests.unit.test_returns import chat
from tests.unit.test_routing import PARAMS, decided, fleet, fp, hold


def test_without_claims_the_odds_are_the_share_of_sessions_still_to_come_back() -> None:
    found = odds([1.0, 2.0, 3.0, None], mu=0.0)
    assert found is not None
    assert found.weight(0.0) == pytest.approx(3 / 4)
    assert found.weight(1.5) == pytest.approx(2 / 3)  # one return is over: 2 of 3 left
    assert found.weight(3.5) == 0.0  # older than every return: only the gone one is left


def test_a_session_due_back_soon_outweighs_a_fresher_one_due_back_later() -> None:
    """Sessions cycling with a 2.4 s gap, a slot taken every 1.2 s: content left 1.2 s ago is
    back in 1.2 s, content just left in 2.4 s."""
    found = odds([2.4] * 10, mu=1 / 2.4)
    assert found is not None
    assert found.weight(1.2) == pytest.approx(math.exp(-0.5))
    assert found.weight(0.0) == pytest.approx(math.exp(-1.0))


def test_no_outcome_yet_gives_no_odds() -> None:
    assert odds([], mu=1.0) is None


@given(
    st.lists(st.one_of(st.none(), st.floats(0, HORIZON)), min_size=1, max_size=60),
    st.floats(0, 1e4),
    st.floats(0, 1e4),
)
def test_the_odds_are_a_probability_for_any_rate_and_age(
    outcomes: list[float | None], mu: float, age: float
) -> None:
    found = odds(outcomes, mu)
    assert found is not None
    assert 0.0 <= found.weight(age) <= 1.0 + 1e-9


def test_the_claim_rate_is_placements_per_second_per_slot() -> None:
    rate = ClaimRate()
    assert rate.rate(slots=4) == 0.0
    for i in range(20):
        rate.placed(0.5 * i)
    assert rate.rate(slots=4) == pytest.approx(0.5)  # one placement per 0.5 s over 4 slots


def test_a_return_after_the_hold_still_counts_for_the_odds_and_a_silent_session_is_gone() -> None:
    tracker = ReturnTracker(max_hold=2.0)
    tracker.released(chat(1, 2), chat(1, 2, 3), now=0.0)
    tracker.released(chat(1, 5), chat(1, 5, 6), now=0.0)
    assert tracker.arrived(chat(1, 2, 3, 4), now=2.4) == pytest.approx(2.4)
    assert tracker.hold(2.4) == 0.0  # for the hold, both are misses
    found = tracker.odds(HORIZON + 1.0, slots=1, mu=0.0)
    assert found is not None
    assert found.gaps == pytest.approx((2.4,))
    assert found.gone == 1


def test_a_turn_evicts_the_session_that_just_left_not_the_one_about_to_return() -> None:
    """Three sessions sharing a system prompt (segment 1) cycle through the two slots of a
    backend that cannot park a slot's content (a sliding-window model without
    ``--swa-full``); the third session's turn must take one of them. By least recent use it
    would take the slot of the session due next; the odds keep that one."""
    f = fleet(2, exact=(True,))  # overwritten content is lost: reused only up to a checkpoint
    hold(f, 0, 0, fp(1, 10, 11), at=98.8)  # session A, left 1.2 s ago: back in 1.2 s
    hold(f, 0, 1, fp(1, 20, 21), at=100.0)  # session B, just left: back in 2.4 s
    found = odds([2.4] * 10, mu=1 / 2.4)
    d = decided(route(fp(1, 30, 31), f.backends, replace(PARAMS, returns=found), now=100.0))
    assert d.placement is not None
    assert d.placement.pin == 1
    # with the half-life prior alone, least recent use decides: A's slot
    d = decided(route(fp(1, 30, 31), f.backends, PARAMS, now=100.0))
    assert d.placement is not None
    assert d.placement.pin == 0


def test_where_the_server_parks_overwritten_content_the_half_life_prior_stays() -> None:
    f = fleet(2)  # the RAM prompt cache parks what a slot loses
    hold(f, 0, 0, fp(1, 10, 11), at=98.8)
    hold(f, 0, 1, fp(1, 20, 21), at=100.0)
    found = odds([2.4] * 10, mu=1 / 2.4)
    with_odds = route(fp(1, 30, 31), f.backends, replace(PARAMS, returns=found), now=100.0)
    assert with_odds == route(fp(1, 30, 31), f.backends, PARAMS, now=100.0)

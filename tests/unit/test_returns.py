"""How fast sessions come back, and the slots held for them (``core.routing.returns``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.routing.decision import Reason, route
from proxy.core.routing.returns import Outcomes, ReturnTracker, estimate, held, lost_if_evicted
from proxy.core.server.fleet import BackendPhase, Fleet, Placement, Probe, SlotProbe
from proxy.core.server.ram_cache import RamEntry
from tests.unit.test_routing import PARAMS, decided, fp


def chat(*segments: int, anchor: int = 2) -> Fingerprint:
    return Fingerprint(segments, tuple(100 * (i + 1) for i in range(len(segments))), anchor)


def test_a_session_continuing_its_last_prompt_is_a_return() -> None:
    tracker = ReturnTracker(max_hold=2.0)
    prompt = chat(1, 2, 3)
    tracker.released(prompt, chat(1, 2, 3, 4), now=10.0)
    assert tracker.arrived(chat(1, 2, 3, 4, 5), now=10.05) == pytest.approx(0.05)
    assert tracker.arrived(chat(1, 2, 3, 4, 6), now=10.06) is None  # counted once
    assert tracker.hold(10.06) == pytest.approx(0.1)  # twice the 90th-percentile gap


def test_the_hold_starts_at_its_bound_and_drops_to_zero_when_sessions_do_not_come_back() -> None:
    tracker = ReturnTracker(max_hold=2.0)
    assert tracker.hold(0.0) == 2.0  # nothing seen yet
    for i in range(10):
        tracker.released(chat(1, 100 + i), chat(1, 100 + i, 7), now=i / 10)
    assert tracker.hold(1.5) == 2.0  # releases younger than the bound are not misses yet
    assert tracker.hold(20.0) == 0.0  # none came back within 2 s


def test_a_request_sharing_only_the_system_prompt_is_not_a_return() -> None:
    tracker = ReturnTracker(max_hold=2.0)
    tracker.released(chat(1, 2), chat(1, 2, 3), now=0.0)  # system 1, first user message 2
    assert tracker.arrived(chat(1, 9), now=0.01) is None
    assert tracker.arrived(chat(1, 2, 3, 4), now=0.02) == pytest.approx(0.02)


def test_a_prefix_two_waiting_sessions_share_names_neither() -> None:
    tracker = ReturnTracker(max_hold=2.0)
    tracker.released(chat(1, 2), chat(1, 2, 3), now=0.0)
    tracker.released(chat(1, 2), chat(1, 2, 4), now=0.0)  # same prompt, another session
    assert tracker.arrived(chat(1, 2, 5), now=0.01) is None
    assert tracker.arrived(chat(1, 2, 4, 6), now=0.02) == pytest.approx(0.02)  # by its reply


def test_shared_misses_wait_for_the_store_and_returns_come_through_it() -> None:
    """Several replicas: a release of this replica that expires is a miss only when the shell
    finds no replica claimed it; returns matched in the store count, once."""
    tracker = ReturnTracker(max_hold=2.0, shared=True)
    first = tracker.released(chat(1, 2), chat(1, 2, 3), now=0.0)
    second = tracker.released(chat(1, 4), chat(1, 4, 5), now=0.0)
    assert first is not None
    assert second is not None
    assert first[1] == (2, 3)
    assert second[1] == (4, 5)
    tracker.returned(0.1, release=first[0])  # its session came back through this replica
    assert tracker.hold(5.0) == pytest.approx(0.2)  # the other expired: not a miss yet
    assert tracker.expired() == [second[0]]
    assert tracker.expired() == []
    tracker.returned(0.3)  # another replica's release, continued here
    tracker.missed(0)  # ``second`` was claimed by another replica
    assert tracker.hold(5.0) == pytest.approx(0.6)
    tracker.missed(3)
    assert tracker.hold(5.0) == 0.0  # two returns in five outcomes


def test_holding_is_off_at_max_hold_zero_while_returns_still_count_for_the_odds() -> None:
    tracker = ReturnTracker(max_hold=0.0)
    tracker.released(chat(1, 2), chat(1, 2, 3), now=0.0)
    assert tracker.arrived(chat(1, 2, 3, 4), now=0.01) == pytest.approx(0.01)
    assert tracker.hold(0.01) == 0.0
    found = tracker.odds(0.01, slots=1, mu=0.0)
    assert found is not None
    assert found.gaps == pytest.approx((0.01,))


@given(st.lists(st.one_of(st.none(), st.floats(0, 2.0)), max_size=50), st.floats(0, 5))
def test_the_estimate_stays_within_its_bound(outcomes: list[float | None], bound: float) -> None:
    assert 0.0 <= estimate(outcomes, bound) <= bound


@given(
    st.lists(st.one_of(st.none(), st.sampled_from([0.1, 0.5, 1.0]), st.floats(0, 2.0))),
    st.integers(1, 12),
    st.floats(0, 5),
)
def test_the_window_kept_sorted_estimates_as_its_last_outcomes_sorted(
    outcomes: list[float | None], size: int, bound: float
) -> None:
    window = Outcomes(size)
    for outcome in outcomes:
        window.add(outcome)
    assert window.estimate(bound) == estimate(outcomes[-size:], bound)


def no_ram_fleet(slots: int = 1, ram: bool = False, ram_tokens: int | None = None) -> Fleet:
    f = Fleet(["b0"], ram=[ram], ram_tokens=[ram_tokens])
    probe = Probe(BackendPhase.READY, tuple(SlotProbe(i, False, 0, -1) for i in range(slots)))
    f.apply_probe(0, probe, now=0.0)
    return f


def left(f: Fleet, slot: int, content: Fingerprint, at: float) -> None:
    f.claim(Placement(0, (slot,), slot), now=at - 1.0, content=content)
    f.release(Placement(0, (slot,), slot), now=at, clean=True, content=content)


def test_a_slot_its_session_just_left_is_held_from_another_session() -> None:
    f = no_ram_fleet()
    left(f, 0, fp(1, 2, 3), at=100.0)
    stranger = route(fp(8, 9), f.backends, PARAMS, now=100.01, hold=0.1)
    d = decided(stranger)
    assert (d.reason, d.placement, d.until) == (Reason.WAIT, None, 100.1)
    back = decided(route(fp(1, 2, 3, 4), f.backends, PARAMS, now=100.01, hold=0.1))
    assert back.reason is Reason.PREFIX
    assert back.placement == Placement(0, (0,), 0)
    later = decided(route(fp(8, 9), f.backends, PARAMS, now=100.2, hold=0.1))
    assert later.reason is Reason.COLD  # the hold is over
    bounded = decided(route(fp(8, 9), f.backends, PARAMS, now=100.01, hold=0.1, allow_wait=False))
    assert bounded.placement == Placement(0, (0,), 0)  # its own wait bound passed: no hold


def test_another_idle_slot_is_taken_instead_of_a_held_one() -> None:
    f = no_ram_fleet(slots=2)
    left(f, 0, fp(1, 2, 3), at=100.0)
    left(f, 1, fp(5, 6), at=50.0)
    d = decided(route(fp(8, 9), f.backends, PARAMS, now=100.01, hold=0.1))
    assert d.placement == Placement(0, (1,), 1)


def test_a_hold_never_outlasts_twice_recomputing_the_content() -> None:
    f = no_ram_fleet()
    left(f, 0, fp(1, 2, 3), at=100.0)  # 300 tokens estimated, none measured
    backend = f.backends[0]
    backend.prefill_tps = 1000.0  # 0.3 s to compute them again
    assert held(backend, backend.slots[0], fp(8, 9), now=100.5, hold=2.0, min_tokens=16)
    assert not held(backend, backend.slots[0], fp(8, 9), now=100.7, hold=2.0, min_tokens=16)
    d = decided(route(fp(8, 9), f.backends, PARAMS, now=100.2, hold=2.0))
    assert d.until == pytest.approx(100.6)
    backend.slots[0].n_tokens = 100  # the server's real length: 0.1 s to compute again
    assert not held(backend, backend.slots[0], fp(8, 9), now=100.3, hold=2.0, min_tokens=16)


def test_content_the_server_can_park_in_ram_is_not_held() -> None:
    unbounded = no_ram_fleet(ram=True)
    left(unbounded, 0, fp(1, 2, 3), at=100.0)
    assert not lost_if_evicted(unbounded.backends[0])
    d = decided(route(fp(8, 9), unbounded.backends, PARAMS, now=100.01, hold=0.1))
    assert d.placement == Placement(0, (0,), 0)
    small = no_ram_fleet(slots=2, ram=True, ram_tokens=400)  # less than its slots hold
    left(small, 0, fp(1, 2, 3), at=100.0)
    left(small, 1, fp(4, 5, 6), at=100.0)
    assert lost_if_evicted(small.backends[0])
    assert decided(route(fp(8, 9), small.backends, PARAMS, now=100.01, hold=0.1)).until


def test_a_backend_whose_idle_slots_are_held_is_full_for_a_request_its_ram_cache_serves() -> None:
    f = Fleet(["b0", "b1"], ram=[True, True], ram_tokens=[250, 250])  # less than 300 held
    for index in (0, 1):
        f.apply_probe(index, Probe(BackendPhase.READY, (SlotProbe(0, False, 0, -1),)), now=0.0)
    left(f, 0, fp(1, 2, 3), at=100.0)
    f.backends[0].ram_entries = [RamEntry(fp(7, 8), 90.0)]  # the request's session, parked in RAM
    d = decided(route(fp(7, 8, 9), f.backends, PARAMS, now=100.01, hold=0.1))
    assert d.reason is Reason.WAIT  # not cold on b1: b0's RAM copy is worth waiting for
    assert d.predicted == 200


def test_a_wait_beside_a_held_slot_names_when_that_hold_ends() -> None:
    """Slot 0 runs the request's own conversation; slot 1, which another session just left,
    is held; slot 2 holds a stranger. Waiting for slot 0 beats the stranger, but the held
    slot would serve nearly as much once its hold ends: the decision says when that is, so
    the request decides again then rather than when slot 0 frees."""
    params = replace(PARAMS, wait_min_tokens=400)  # slot 0 saves 100 more than slot 1
    f = no_ram_fleet(slots=3)
    system = (1, 2, 3, 4, 5, 6, 7, 8, 9)  # 900 tokens the sessions share
    left(f, 2, chat(70, 71), at=10.0)
    left(f, 1, chat(*system, 20, anchor=10), at=100.0)
    f.claim(Placement(0, (0,), 0), now=99.0, content=chat(*system, 30, anchor=10))
    d = decided(route(chat(*system, 30, 31, anchor=10), f.backends, params, now=100.01, hold=0.1))
    assert (d.reason, d.placement, d.wait_for, d.until) == (Reason.WAIT, None, (0, 0), None)
    assert d.wakes is not None
    assert d.hold_end is not None
    assert d.hold_end[0] == pytest.approx(100.1)
    assert d.hold_end[1] == (0, 1)
    after = decided(
        route(chat(*system, 30, 31, anchor=10), f.backends, params, now=100.2, hold=0.1)
    )
    assert after.placement == Placement(0, (1,), 1)  # (the hold is over: it takes slot 1)
    alone = no_ram_fleet(slots=2)  # no slot held: nothing to decide again for
    left(alone, 1, chat(70, 71), at=10.0)
    alone.claim(Placement(0, (0,), 0), now=99.0, content=chat(*system, 30, anchor=10))
    d = decided(
        route(chat(*system, 30, 31, anchor=10), alone.backends, params, now=100.01, hold=0.1)
    )
    assert (d.wait_for, d.hold_end) == ((0, 0), None)

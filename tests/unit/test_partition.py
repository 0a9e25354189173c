from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.replicas.partition import HEARTBEAT_TTL, Fence, Peers, fenced, fences, owns


def test_two_replicas_on_two_by_two_each_keep_one_slot_of_every_backend() -> None:
    counts, replicas = [2, 2], ["r-a", "r-b"]
    mine = {
        r: {(b, s) for b in (0, 1) for s in (0, 1) if owns(b, s, counts, replicas, r)}
        for r in replicas
    }
    assert mine == {"r-a": {(0, 0), (1, 0)}, "r-b": {(0, 1), (1, 1)}}


def test_a_replica_that_knew_no_other_keeps_every_slot() -> None:
    assert all(owns(b, s, [3, 1], [], "me") for b, s in [(0, 0), (0, 2), (1, 0)])
    assert all(owns(b, s, [3, 1], ["me"], "me") for b, s in [(0, 0), (0, 2), (1, 0)])


@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=5),
    st.sets(st.text("abcdef", min_size=1, max_size=4), min_size=1, max_size=6),
)
def test_property_the_parts_are_disjoint_and_cover_the_fleet(
    counts: list[int], replicas: set[str]
) -> None:
    ids = sorted(replicas)
    for b, n in enumerate(counts):
        for s in range(n):
            assert sum(owns(b, s, counts, ids, r) for r in ids) == 1


def test_a_replica_whose_heartbeat_lapsed_is_fenced_and_one_that_left_is_not() -> None:
    before = ["a", "b", "c"]
    found = fences(before, ["a"], {"c"}, {}, "a", now=10.0, hold=30.0)
    assert found == {"b": Fence("b", 10.0, ("a", "b", "c"))}  # c left: nothing to keep off
    again = fences(["a"], ["a"], set(), found, "a", now=12.0, hold=30.0)
    assert again == found  # still gone: fenced from when it vanished, not re-dated
    assert fences(["a"], ["a", "b"], set(), again, "a", now=13.0, hold=30.0) == {}  # live again
    assert fences(["a"], ["a"], set(), again, "a", now=40.0, hold=30.0) == {}  # held long enough


def test_a_replica_restarted_at_the_same_url_lifts_its_predecessors_fence() -> None:
    a, b, b2 = "a@http://h1:8000", "b@http://h2:8000", "b2@http://h2:8000"
    found = fences([a, b], [a], set(), {}, a, now=10.0, hold=30.0)
    assert set(found) == {b}  # b crashed
    assert fences([a], [a, b2], set(), found, a, now=11.0, hold=30.0) == {}  # back at h2
    assert fences([a, b], [a, b2], set(), {}, a, now=11.0, hold=30.0) == {}  # seen at once
    other = "c@http://h3:8000"  # a replica at another address does not vouch for b
    assert set(fences([a], [a, other], set(), found, a, now=11.0, hold=30.0)) == {b}
    assert set(fences([a, "b"], [a, "b2"], set(), {}, a, now=11.0, hold=30.0)) == {"b"}  # no URL


def test_a_fence_covers_the_vanished_replicas_part_of_the_split_it_was_listed_in() -> None:
    counts, peers = [2, 2], ("r-a", "r-b")
    fence = Fence("r-b", 10.0, peers)
    kept = {(b, s) for b in (0, 1) for s in (0, 1) if fenced(b, s, counts, [fence], 11.0, 30.0)}
    assert kept == {(b, s) for b in (0, 1) for s in (0, 1) if owns(b, s, counts, peers, "r-b")}
    assert kept == {(0, 1), (1, 1)}
    assert not any(fenced(b, s, counts, [fence], 40.0, 30.0) for b in (0, 1) for s in (0, 1))


def test_a_fence_acts_at_once_and_is_reported_once_it_has_stood_a_heartbeat_ttl() -> None:
    peers = Peers("a", hold=30.0)
    peers.beat(["a", "b"], set(), now=10.0)
    assert peers.beat(["a"], set(), now=11.0) == []  # b's heartbeat lapsed (or a store restart)
    assert peers.fenced(0, 1, [2], now=11.0)
    assert not peers.reported
    assert peers.beat(["a"], set(), now=11.5) == []
    (fence,) = peers.beat(["a"], set(), now=11.0 + HEARTBEAT_TTL)
    assert fence.replica == "b"
    assert peers.reported == {"b"}
    assert peers.beat(["a"], set(), now=12.5) == []  # reported once
    peers.beat(["a", "b"], set(), now=13.0)
    assert not peers.fences
    assert not peers.reported


def test_a_replica_that_never_reached_the_store_pins_nothing_in_an_outage() -> None:
    """Started while the store is down, it knows no peer, but its peers may be pinning their
    parts of a split it is not in: every slot it would pin could be theirs."""
    peers = Peers("new", hold=30.0)
    assert peers.may_claim(("b0", 0), 0, [2], now=100.0) is False
    peers.beat([], [], now=100.0)  # it reached the store once, alone
    assert peers.may_claim(("b0", 0), 0, [2], now=101.0) is True


def test_a_lease_standing_in_the_store_keeps_only_a_slot_of_this_replicas_part() -> None:
    """The store went down while replica a leased slot 1, which is b's part of the split: in
    a full outage b cannot see that lease and pins its part, so a does not pin it on the
    strength of the lease (both pinned it before); its own part's leased slot it still does."""
    peers = Peers("a", hold=30.0)
    peers.beat(["a", "b"], [], now=0.0)
    peers.went_down([("b0", 0), ("b0", 1)], now=1.0)
    assert peers.owns(0, 0, [2])
    assert not peers.owns(0, 1, [2])
    assert peers.may_claim(("b0", 0), 0, [2], now=1.5) is True  # its part, leased
    assert peers.may_claim(("b0", 1), 0, [2], now=1.5) is None  # b's part: not before claims
    assert peers.may_claim(("b0", 1), 0, [2], now=5.0) is False  # nor after

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.config.settings import Settings
from proxy.core.replicas.homes import advertisers, clashes, home, replica_id, target, url_of
from proxy.core.routing.decision import Decision, Reason
from proxy.core.server.fleet import NoPlacement, Placement
from proxy.http.forwarding import advertised_url

A = replica_id("aaa", "http://10.0.0.1:8000")
B = replica_id("bbb", "http://10.0.0.2:8000")


def test_two_replicas_on_two_backends_home_one_each() -> None:
    assert url_of(A) == "http://10.0.0.1:8000"
    assert url_of("aaa") is None
    assert [home(b, [A, B], A) for b in range(4)] == [None, url_of(B), None, url_of(B)]
    assert [home(b, [A, B], B) for b in range(4)] == [url_of(A), None, url_of(A), None]


def test_no_forwarding_alone_without_a_url_or_to_an_unreachable_home() -> None:
    assert home(1, [A], A) is None  # alone
    assert home(1, [], A) is None  # no heartbeat read yet
    assert home(1, [A, B], "ccc") is None  # this replica advertises no URL
    assert home(1, [A, "ccc"], A) is None  # nor does the other: it is no one's home
    assert home(1, [A, B], A, unreachable={url_of(B) or ""}) is None


def test_advertisers_are_the_live_replicas_with_a_url_and_this_one() -> None:
    assert advertisers([B, "ccc"], A) == [A, B]
    assert advertisers([A], A) == [A]  # alone: the forwarder skips working out a target
    assert advertisers([A, B], "ccc") == []  # this replica forwards nothing


def test_replicas_advertising_one_url_are_no_ones_home() -> None:
    """Two live replicas give one URL (every one configured with the load balancer's, say):
    a request forwarded there could land on either, so neither counts; the rest still split
    the backends, and a replica whose own URL clashes forwards nothing."""
    c, d = replica_id("ccc", "http://lb:8000"), replica_id("ddd", "http://lb:8000")
    assert clashes([A, c, d]) == {"http://lb:8000": [c, d]}
    assert advertisers([A, B, c, d], A) == [A, B]
    assert advertisers([A, B, c, d], c) == []
    assert [home(b, [A, B, c, d], c) for b in range(2)] == [None, None]
    assert advertisers([A, c, d], A) == [A]  # alone among advertisers: no forwarding


def test_a_replica_that_restarts_at_its_address_keeps_every_home() -> None:
    """A restart gives a replica a new token; at the same URL the split is the same."""
    c = replica_id("ccc", "http://10.0.0.3:8000")
    before = [home(b, [A, B, c], A) for b in range(6)]
    restarted = replica_id("000", url_of(B))  # a token that sorts first
    assert [home(b, [A, restarted, c], A) for b in range(6)] == before
    assert advertisers([A, restarted, c], A) == [A, restarted, c]


@given(st.sets(st.text("abcdef", min_size=1, max_size=4), min_size=2, max_size=6), st.data())
def test_property_every_replica_agrees_on_each_backends_home(
    tokens: set[str], data: st.DataObject
) -> None:
    ids = [replica_id(t, f"http://{t}:1") for t in sorted(tokens)]
    for backend in range(data.draw(st.integers(1, 8))):
        homes = {home(backend, ids, me) or url_of(me) for me in ids}
        assert len(homes) == 1  # each sends it to the same replica, or is that replica


def test_the_target_is_the_backend_placed_on_or_waited_for() -> None:
    assert target(Decision(Placement(1, (0,), 0), Reason.PREFIX, 10)) == 1
    assert target(Decision(None, Reason.WAIT, 10, (2, -1))) == 2
    assert target(NoPlacement.BUSY) is None


def _settings(**over: object) -> Settings:
    data = {"backends": ["http://a:1"], "replicas": {"secret": "replicas shared secret"}, **over}
    return Settings.model_validate(data)


@pytest.mark.parametrize(
    ("over", "url"),
    [
        ({}, None),  # embedded store: no peers
        ({"redis_url": "redis://127.0.0.1:6379"}, "http://127.0.0.1:8000"),
        ({"redis_url": "redis://127.0.0.1:6379", "listen": "0.0.0.0:9000"},
         "http://127.0.0.1:9000"),  # the address that reaches Redis
        ({"redis_url": "redis://10.9.9.9:6379", "listen": "127.0.0.1:8000"}, None),
        ({"redis_url": "redis://10.9.9.9:6379", "replica_url": "http://p1:8000/"},
         "http://p1:8000"),
        ({"redis_url": "redis://127.0.0.1:6379", "replica_url": "off"}, None),
        ({"redis_url": "unix:///run/redis.sock"}, "http://127.0.0.1:8000"),
        ({"redis_url": "redis://127.0.0.1:6379", "replicas": {}}, None),  # no secret: none
    ],
)  # fmt: skip
def test_the_url_a_replica_advertises(over: dict[str, object], url: str | None) -> None:
    assert advertised_url(_settings(**over)) == url

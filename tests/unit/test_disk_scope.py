from __future__ import annotations

import pytest

from proxy.core.disk.scope import (
    Scope,
    ScopeMode,
    narrowed,
    narrower,
    parse_scope,
    select_prefix,
    with_window,
)
from proxy.core.prompt.fingerprint import Fingerprint


def fp(*segments: int, size: int = 100) -> Fingerprint:
    """A chain whose i-th hash encodes the prefix (so equal prefixes share hashes)."""
    hashes = tuple(hash(segments[: i + 1]) for i in range(len(segments)))
    return Fingerprint(hashes, tuple(size * (i + 1) for i in range(len(segments))), anchor=2)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("off", Scope(ScopeMode.OFF)),
        ("full", Scope(ScopeMode.FULL)),
        ("auto", Scope(ScopeMode.AUTO, window=30)),
        ("AUTO:8", Scope(ScopeMode.AUTO, window=8)),
        ("1000", Scope(ScopeMode.FIXED, tokens=1000)),
    ],
)
def test_parse_scope(text: str, expected: Scope) -> None:
    assert parse_scope(text) == expected
    assert parse_scope(str(expected)) == expected


@pytest.mark.parametrize("text", ["", "sometimes", "auto:", "auto:0", "auto:x", "-5", "0", "1.5"])
def test_parse_scope_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="must be"):
        parse_scope(text)


def test_window_override_applies_to_auto_only() -> None:
    assert with_window(parse_scope("auto"), 4) == Scope(ScopeMode.AUTO, window=4)
    assert with_window(parse_scope("500"), 4) == parse_scope("500")
    with pytest.raises(ValueError, match="window"):
        with_window(parse_scope("auto"), 0)


def test_auto_with_an_empty_window_selects_nothing() -> None:
    choice = select_prefix(parse_scope("auto"), fp(1, 2, 3), [], 1)
    assert (choice.segments, choice.candidates) == (0, 0)


def test_auto_selects_what_half_of_the_related_requests_share() -> None:
    request = fp(0, 1, 5, 6, 7)  # system 0+1, then its own turns 5..
    window = [
        fp(0, 1, 5, 6),  # its own previous turn: shares 4
        fp(0, 1, 8, 9),  # other sessions of the same agent: share 2
        fp(0, 1, 3),
        fp(9, 9),  # another agent: shares nothing and does not vote
    ]
    choice = select_prefix(parse_scope("auto:30"), request, window, 1)
    assert choice.candidates == 3
    assert choice.segments == 2  # system and tools: what most sessions keep sharing
    assert choice.tokens == 200


def test_larger_windows_give_shorter_more_stable_prefixes() -> None:
    request = fp(0, 1, 5, 6, 7, 8)
    window = [fp(0, 1, 5, 6, 7), fp(0, 1, 5, 6)] + [fp(0, 1, i) for i in range(10, 40)]
    chosen = {
        n: select_prefix(parse_scope(f"auto:{n}"), request, window, 1).segments for n in (2, 8, 30)
    }
    assert chosen[2] == 5  # the session's own recent history
    assert chosen[8] == 2
    assert chosen[30] == 2
    assert chosen[2] >= chosen[8] >= chosen[30]


def test_min_tokens_drops_small_prefixes() -> None:
    request = fp(0, 1, 5)
    window = [fp(0, 1, 7), fp(0, 1, 8)]
    assert select_prefix(parse_scope("auto"), request, window, 201).segments == 0
    assert select_prefix(parse_scope("auto"), request, window, 200).segments == 2


def test_fixed_scope_aligns_down_to_a_segment_boundary() -> None:
    request = fp(0, 1, 2, 3)  # boundaries at 100, 200, 300, 400 tokens
    assert select_prefix(parse_scope("250"), request, [], 1).segments == 2
    assert select_prefix(parse_scope("400"), request, [], 1).segments == 4
    assert select_prefix(parse_scope("50"), request, [], 1).segments == 0


def test_off_and_full_select_no_prefix() -> None:
    request = fp(0, 1, 2)
    assert select_prefix(parse_scope("off"), request, [request], 1).segments == 0
    assert select_prefix(parse_scope("full"), request, [request], 1).segments == 0


@pytest.mark.parametrize(
    ("operator", "client", "used"),
    [
        ("off", "full", "off"),  # off is final
        ("off", "auto:1", "off"),
        ("off", "100", "off"),
        ("off", "off", "off"),
        ("full", "off", "off"),  # everything narrows full
        ("full", "auto:5", "auto:5"),
        ("full", "100", "100"),
        ("full", "full", "full"),
        ("auto:30", "off", "off"),
        ("auto:30", "auto:60", "auto:60"),  # a larger window: a shorter, stabler prefix
        ("auto:30", "auto:30", "auto:30"),
        ("auto:30", "auto:2", "auto:30"),  # a smaller window widens: the operator's
        ("auto:30", "full", "auto:30"),
        ("auto:30", "500", "auto:30"),  # not comparable
        ("1000", "500", "500"),
        ("1000", "1000", "1000"),
        ("1000", "2000", "1000"),
        ("1000", "auto:100", "1000"),
        ("1000", "full", "1000"),
    ],
)
def test_a_client_scope_only_narrows_the_operators(operator: str, client: str, used: str) -> None:
    chosen = narrowed(parse_scope(operator), parse_scope(client))
    assert str(chosen) == used
    assert narrower(parse_scope(client), parse_scope(operator)) == (used == client)
    assert narrowed(parse_scope(operator), None) == parse_scope(operator)

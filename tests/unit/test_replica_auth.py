"""Signed heartbeat entries, forwarding marks, and the forwarding allowlist."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from proxy.core.replicas.auth import (
    PRIVATE,
    allowed,
    request_parts,
    sign_entry,
    sign_forward,
    verify_entry,
    verify_forward,
)

KEY = b"shared"
ME = "abc@http://10.0.0.5:8000"


def test_an_entry_verifies_until_the_expiry_it_signed() -> None:
    entry = sign_entry(KEY, ME, 1000.0)
    assert verify_entry(KEY, entry, 1000.0) == ME
    assert verify_entry(KEY, entry, 999.5) == ME  # lapses sooner: fine
    assert verify_entry(KEY, entry, 1e12) is None  # re-added with a far-future score
    assert verify_entry(b"other", entry, 1000.0) is None


@pytest.mark.parametrize(
    "entry",
    [
        ME,  # unsigned
        "x@http://attacker",
        "x@http://attacker|9999999999.000|" + "0" * 64,  # a made-up signature
        sign_entry(KEY, ME, 1000.0).replace("10.0.0.5", "10.0.0.6"),  # another URL
        sign_entry(KEY, ME, 1000.0).replace("1000.000", "9000.000"),  # a later expiry
        "a|nan|" + "0" * 64,
        "",
        "||",
    ],
)
def test_an_entry_that_was_not_signed_with_the_secret_is_refused(entry: str) -> None:
    assert verify_entry(KEY, entry, 10.0) is None


def _mac(*parts: str) -> str:
    return hmac.new(KEY, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def test_a_signed_entry_whose_expiry_is_not_a_number_is_refused() -> None:
    assert verify_entry(KEY, f"a|soon|{_mac('beat', 'a', 'soon')}", 0.0) is None


def test_a_forwarding_mark_verifies_for_its_request_within_the_window_only() -> None:
    parts = request_parts("r1", "POST", "/v1/chat/completions", b'{"a":1}')
    mark = sign_forward(KEY, ME, 100.0, parts)
    assert verify_forward(KEY, mark, parts, 105.0, 10.0) == ME
    assert verify_forward(KEY, mark, parts, 95.0, 10.0) == ME  # the sender's clock ahead
    assert verify_forward(KEY, mark, parts, 111.0, 10.0) is None  # a replay, too late
    other_body = request_parts("r1", "POST", "/v1/chat/completions", b'{"a":2}')
    assert verify_forward(KEY, mark, other_body, 100.0, 10.0) is None
    other_id = request_parts("r2", "POST", "/v1/chat/completions", b'{"a":1}')
    assert verify_forward(KEY, mark, other_id, 100.0, 10.0) is None
    assert verify_forward(b"other", mark, parts, 100.0, 10.0) is None
    for forged in ["another replica", "", ";;", f"{ME};100.000;" + "0" * 64]:
        assert verify_forward(KEY, forged, parts, 100.0, 10.0) is None


def test_a_mark_whose_time_is_not_a_number_is_refused() -> None:
    parts = request_parts("r1", "GET", "/", b"")
    mark = f"a;x;{_mac('forward', 'a', 'x', *parts)}"
    assert verify_forward(KEY, mark, parts, 0.0, 10.0) is None


@pytest.mark.parametrize(
    "text",
    [
        "x|99999999999|\ufffd",  # a store's undecodable bytes, as read
        "x|99999999999|" + "\u00e9" * 64,  # not hex, of the MAC's length
        "x|1.0|" + "0" * 63 + "\u00e9",
        "\ud800|1.0|" + "0" * 64,  # a lone surrogate: cannot be encoded
        "x|1.0|" + "A" * 64,  # upper-case hex: never what is signed
    ],
)
def test_any_text_is_refused_never_an_error(text: str) -> None:
    """A MAC that is not hex was compared as text, which raises TypeError for non-ASCII."""
    assert verify_entry(KEY, text, 0.0) is None
    mark = text.replace("|", ";")
    assert verify_forward(KEY, mark, request_parts("r", "GET", "/", b""), 1.0, 10.0) is None


@pytest.mark.parametrize("stamp", ["nan", "inf", "-inf"])
def test_a_signed_time_that_is_not_finite_is_refused(stamp: str) -> None:
    assert verify_entry(KEY, f"a|{stamp}|{_mac('beat', 'a', stamp)}", 0.0) is None
    parts = request_parts("r1", "GET", "/", b"")
    mark = f"a;{stamp};{_mac('forward', 'a', stamp, *parts)}"
    assert verify_forward(KEY, mark, parts, 0.0, float("inf")) is None


@pytest.mark.parametrize(
    ("url", "allow", "expected"),
    [
        ("http://10.1.2.3:8000", PRIVATE, True),
        ("http://127.0.0.1:9", PRIVATE, True),
        ("http://[::1]:8000", PRIVATE, True),
        ("http://8.8.8.8:8000", PRIVATE, False),  # public address
        ("http://attacker", PRIVATE, False),  # a host name: whatever its DNS says
        ("http://attacker:8000", ("http://attacker:8000",), True),  # listed as an origin
        ("http://attacker:8001", ("http://attacker:8000",), False),
        ("https://peer", ("https://peer:443",), True),
        ("http://peer", ("http://peer:80",), True),
        ("ftp://10.0.0.1", PRIVATE, False),
        ("http://10.0.0.1:99999", PRIVATE, False),  # not a port
        ("http://", PRIVATE, False),
        ("http://10.0.0.1:8000", ("192.168.0.0/16",), False),
        ("http://10.0.0.1:8000", (), False),
        ("https://peer:443", ("https://peer",), True),  # the default port either side
        ("http://peer:443", ("https://peer",), False),  # another scheme
    ],
)
def test_only_allowlisted_replica_urls_are_forwarded_to(
    url: str, allow: tuple[str, ...], expected: bool
) -> None:
    assert allowed(url, allow) is expected

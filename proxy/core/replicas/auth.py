"""How replicas tell each other from anyone else who can write to the state store.

The store is not trusted to say where requests may go: whoever can write to it could list a
"replica" at any URL, and a replica would forward its clients' prompts and credentials there.
So replicas that share a secret (``replicas.secret``) sign what they tell each other, with
HMAC-SHA256, and believe nothing unsigned:

- *Heartbeat entries*: ``<replica id>|<expiry>|<hex HMAC of "beat", id, expiry>``; the expiry
  is on the store's clock (seconds, three decimals) and the entry's score in the store (when
  the store lets it lapse) must not be later than it. A copy of an old entry re-added later,
  or with a far-future score, lists nothing: a writer without the secret can hide replicas
  (the store is theirs) but never add one, move one to another URL or keep one alive.
- *The forwarding mark* (``X-Cache-Forwarded-By``): ``<sender id>;<sent at>;<hex HMAC of
  "forward", sender, sent at, request id, method, path with its query string as sent,
  SHA-256 of the body>``; not the other headers. It is believed only when it verifies for
  this very request and was sent within ``window`` seconds of the receiver's clock (a
  captured mark replays for that long at most, and only that request).
- *Checking*: a MAC that is not 64 lower-case hex digits is refused before it is compared,
  and any text at all is refused, never an error (``_signed``: one check for both).
- *Where to forward*: only to a URL on the allowlist (``allowed``): an ``ip/prefix`` network
  its host, written as an IP address, lies in (any port), or an exact ``scheme://host:port``
  origin. A host name matches only an origin listed with it; a network never matches one (a
  name resolves to whatever its DNS says).

Without a secret nothing is signed or verified: entries are read as plain ids (liveness only)
and the proxy does not forward (``proxy.http.forwarding``).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
from collections.abc import Sequence
from urllib.parse import urlsplit

# IP literals in private and loopback networks: the default allowlist (never a public
# address, never a host name)
PRIVATE = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "127.0.0.0/8", "fc00::/7", "::1/128")
_HEX = frozenset("0123456789abcdef")  # the digits of ``hexdigest``


def _mac(secret: bytes, *parts: str) -> str:
    message = "\n".join(parts).encode("utf-8", "surrogateescape")
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _signed(secret: bytes, text: str, sep: str, kind: str, *bound: str) -> tuple[str, float] | None:
    """The signer and time of ``<signer><sep><time><sep><hex HMAC of kind, signer, time,
    bound>`` when that HMAC holds; None otherwise, for any text at all (a MAC that is not
    64 hex digits is refused before it is compared; so is text that cannot be encoded, or a
    time that is not a finite number)."""
    head, _, mac = text.rpartition(sep)
    signer, _, stamp = head.rpartition(sep)
    if not signer or len(mac) != 64 or not all(c in _HEX for c in mac):
        return None
    try:
        expected = _mac(secret, kind, signer, stamp, *bound)
        at = float(stamp)
    except ValueError:  # (UnicodeEncodeError too: a lone surrogate)
        return None
    if not math.isfinite(at) or not hmac.compare_digest(mac.encode(), expected.encode()):
        return None
    return signer, at


def sign_entry(secret: bytes, replica: str, expires: float) -> str:
    """The heartbeat entry of ``replica``, valid until ``expires`` (the store's clock)."""
    stamp = f"{expires:.3f}"
    return f"{replica}|{stamp}|{_mac(secret, 'beat', replica, stamp)}"


def verify_entry(secret: bytes, entry: str, score: float) -> str | None:
    """The replica id of a heartbeat entry whose signature holds and whose ``score`` (when
    the store drops it) is not past the expiry it signed; None otherwise."""
    signed = _signed(secret, entry, "|", "beat")
    return signed[0] if signed is not None and score <= signed[1] + 0.001 else None


def request_parts(request_id: str, method: str, path: str, body: bytes) -> tuple[str, ...]:
    """What a forwarding mark is bound to: the request's id, method, path (with its query
    string, still percent-encoded) and body."""
    return (request_id, method, path, hashlib.sha256(body).hexdigest())


def sign_forward(secret: bytes, sender: str, now: float, request: Sequence[str]) -> str:
    """The ``X-Cache-Forwarded-By`` value for ``request`` (``request_parts``) sent now."""
    stamp = f"{now:.3f}"
    return f"{sender};{stamp};{_mac(secret, 'forward', sender, stamp, *request)}"


def verify_forward(
    secret: bytes, mark: str, request: Sequence[str], now: float, window: float
) -> str | None:
    """The sender of a forwarding mark that verifies for ``request`` and was sent within
    ``window`` seconds of ``now``; None otherwise."""
    signed = _signed(secret, mark, ";", "forward", *request)
    return signed[0] if signed is not None and abs(now - signed[1]) <= window else None


def _origin(url: str) -> tuple[str, str | None, int]:
    """A URL's scheme, host and port (the scheme's default when none is written); raises
    ValueError for a port that is not one."""
    parts = urlsplit(url)
    return parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def allowed(url: str, allow: Sequence[str]) -> bool:
    """Whether a replica at ``url`` may be forwarded to (see the module docstring)."""
    try:
        origin = _origin(url)
    except ValueError:
        return False
    scheme, host, _ = origin
    if scheme not in ("http", "https") or not host:
        return False
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for rule in allow:
        if "://" in rule:
            if _origin(rule) == origin:
                return True
        elif address is not None and address in ipaddress.ip_network(rule, strict=False):
            return True
    return False

"""Which headers cross the proxy.

Hop-by-hop headers (RFC 9110 §7.6.1) never cross. Headers that would change llama-server's
behaviour in ways the proxy must control are dropped too: ``X-Conversation-Id`` makes a
generation survive client disconnect (it would keep a slot busy that the proxy believes
free), and ``Accept-Encoding`` is dropped so the proxy can read usage from the bytes it
relays. Framing headers (``Content-Length``, ``Transfer-Encoding``) are recomputed, and a
request's ``Content-Encoding`` is dropped: the proxy forwards the body as it read it,
decoded (llama-server takes no encoded request body: 415).

aiohttp decodes header bytes as UTF-8 with surrogate escapes, so a byte that is not UTF-8
becomes a lone surrogate that fails any later ``encode()`` (hashing, Redis, logging).
``header_text`` reads a header the proxy itself interprets and refuses such a value as a
400 naming the header; headers merely relayed upstream keep their bytes.

API keys: ``presented_key`` reads a client's key as llama-server does (``Authorization``,
else ``X-Api-Key``, minus a ``Bearer `` prefix). ``with_credential`` puts a backend's own key
in place of the client's credentials: the proxy's key authenticates the client to the proxy,
the backend's key the proxy to the backend. Without a backend key, the client's headers
cross unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from proxy.errors import InvalidRequest

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
FORWARDED_BY = "X-Cache-Forwarded-By"  # between replicas only (``proxy.http.forwarding``)
_REQUEST_DROP = HOP_BY_HOP | {
    "host",
    "content-length",
    "content-encoding",
    "accept-encoding",
    "x-conversation-id",
    FORWARDED_BY.lower(),
}
_RESPONSE_DROP = HOP_BY_HOP | {"content-length", "content-encoding", "server", "date"}


def _connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    tokens: set[str] = set()
    for name, value in headers:
        if name.lower() == "connection":
            tokens |= {part.strip().lower() for part in value.split(",")}
    return tokens


def _filter(headers: Iterable[tuple[str, str]], drop: frozenset[str]) -> list[tuple[str, str]]:
    pairs = list(headers)
    named = _connection_tokens(pairs)
    return [(k, v) for k, v in pairs if k.lower() not in drop and k.lower() not in named]


def upstream_request_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return _filter(headers, _REQUEST_DROP)


def client_response_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return _filter(headers, _RESPONSE_DROP)


def presented_key(headers: Mapping[str, str]) -> str:
    """The API key a request presents, read as llama-server reads it."""
    key = headers.get("Authorization", "") or headers.get("X-Api-Key", "")
    return key.removeprefix("Bearer ")


def with_credential(headers: list[tuple[str, str]], key: str | None) -> list[tuple[str, str]]:
    """``headers`` carrying ``key`` (a backend's API key) instead of the client's own."""
    if key is None:
        return headers
    kept = [(k, v) for k, v in headers if k.lower() not in ("authorization", "x-api-key")]
    return [*kept, ("Authorization", f"Bearer {key}")]


def header_text(headers: Mapping[str, str], name: str) -> str:
    """``name``'s value ('' when absent); a value whose bytes are not UTF-8 is a 400."""
    value = headers.get(name, "")
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            message = f"header {name} is not valid UTF-8"
            raise InvalidRequest(message, code="invalid_header", param=name) from None
    return value


def cache_key(
    sources: tuple[str, ...], body: dict[str, Any], headers: Mapping[str, str]
) -> str | None:
    """A request's cache_key: the first of ``sources`` (a body field, or ``header:NAME``) it
    sets to a non-empty string, cut to 256 characters."""
    for source in sources:
        name = source.removeprefix("header:")
        value = header_text(headers, name) if name != source else body.get(source)
        if isinstance(value, str) and value:
            return value[:256]
    return None

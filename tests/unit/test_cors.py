"""The proxy's own answers get the CORS headers a backend gave the same origin."""

from __future__ import annotations

from aiohttp import web

from proxy.http import cors
from proxy.http.cors import CorsMirror
from proxy.upstream import PROBE_ORIGIN

ACAO = "Access-Control-Allow-Origin"


def _forwarded(origin: str | None) -> web.Response:
    return web.Response(headers={ACAO: origin} if origin else {})


def test_an_origin_a_backend_allowed_gets_its_headers_and_no_other() -> None:
    mirror = CorsMirror()
    mirror.answer("http://a", _forwarded("http://a"), forwarded=True)
    own = web.Response()
    mirror.answer("http://a", own, forwarded=False)
    assert own.headers[ACAO] == "http://a"
    stranger = web.Response()
    mirror.answer("http://b", stranger, forwarded=False)
    assert ACAO not in stranger.headers
    mirror.answer("http://a", _forwarded(None), forwarded=True)  # no longer allowed
    later = web.Response()
    mirror.answer("http://a", later, forwarded=False)
    assert ACAO not in later.headers


def test_the_origins_kept_are_bounded() -> None:
    mirror = CorsMirror()
    for i in range(cors.ORIGINS + 10):
        mirror.answer(f"http://{i}", _forwarded(f"http://{i}"), forwarded=True)
    first, last = web.Response(), web.Response()
    mirror.answer("http://0", first, forwarded=False)
    mirror.answer(f"http://{cors.ORIGINS + 9}", last, forwarded=False)
    assert ACAO not in first.headers  # the least recently seen went first
    assert last.headers[ACAO] == f"http://{cors.ORIGINS + 9}"


def test_an_origin_not_seen_yet_is_allowed_only_if_every_backend_allows_any() -> None:
    """The proxy's ``/health`` probes carry an origin of their own: a backend that echoed it
    allows every origin (llama-server's default); one that did not allows fewer, and the
    proxy's own answers then allow no origin no forwarded answer has shown."""
    probed = {"http://b1": {ACAO: PROBE_ORIGIN, "Vary": "Origin"}}
    mirror = CorsMirror(probed)
    own = web.Response()
    mirror.answer("http://app", own, forwarded=False)
    assert (own.headers[ACAO], own.headers["Vary"]) == ("http://app", "Origin")
    probed["http://b2"] = {ACAO: "http://only.example"}
    narrowed = web.Response()
    mirror.answer("http://app", narrowed, forwarded=False)
    assert ACAO not in narrowed.headers
    assert ACAO not in _own(CorsMirror())  # nothing probed yet


def _own(mirror: CorsMirror) -> web.Response:
    response = web.Response()
    mirror.answer("http://app", response, forwarded=False)
    return response

"""CORS headers on the proxy's own answers, as the backends give them.

llama-server answers a browser's request from another origin with its CORS headers (by
default it allows every origin, echoing it; ``--cors-*`` settings narrow that). Requests the
proxy forwards carry the backend's headers, and so do preflights (``OPTIONS``, forwarded).
What the proxy answers itself (``/health``, ``/metrics``, its errors, a 503 while it queues)
would carry none, and a browser would hide the answer from the page. ``CorsMirror`` learns,
per origin, the CORS headers a backend gave a forwarded answer, and puts the same on the
proxy's own answers to that origin: never more than a backend allowed it. An origin no
forwarded answer has shown yet gets what the backends give any origin: the proxy's ``/health``
probes carry an Origin of their own (``upstream.PROBE_ORIGIN``), and when every backend probed
echoed it (llama-server's default), the proxy echoes the origin too, with the other headers
they gave; else none. At most ``ORIGINS`` origins are kept (the least recently learned go
first): the ``Origin`` header is the client's to choose.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from aiohttp import web

from proxy.upstream import PROBE_ORIGIN

ORIGINS = 256  # origins whose backend headers are kept (a browser app is one origin)
ALLOW_ORIGIN = "Access-Control-Allow-Origin"
HEADERS = (
    ALLOW_ORIGIN,
    "Access-Control-Allow-Credentials",
    "Access-Control-Expose-Headers",
    "Vary",
)


class CorsMirror:
    def __init__(self, probed: Mapping[str, Mapping[str, str]] | None = None) -> None:
        """``probed``: per backend, the CORS headers of its last healthy ``/health`` probe
        (``LlamaServerClient.probe_cors``)."""
        self._learned: OrderedDict[str, dict[str, str]] = OrderedDict()
        self._probed = probed if probed is not None else {}

    def answer(self, origin: str, response: web.StreamResponse, forwarded: bool) -> None:
        """Learn from a ``forwarded`` answer to ``origin``; give one of the proxy's own the
        headers learned (if it is not sent yet)."""
        if forwarded:
            found = {h: response.headers[h] for h in HEADERS if h in response.headers}
            if "Access-Control-Allow-Origin" in found:
                self._learned[origin] = found
                self._learned.move_to_end(origin)
                while len(self._learned) > ORIGINS:
                    self._learned.popitem(last=False)
            else:
                self._learned.pop(origin, None)  # (the backend no longer allows it)
            return
        learned = self._learned.get(origin) or self._any_origin(origin)
        if learned is not None and not response.prepared:
            for header, value in learned.items():
                response.headers.setdefault(header, value)

    def _any_origin(self, origin: str) -> dict[str, str] | None:
        """The headers for ``origin`` when every backend probed allows any origin (each
        echoed the probe's); None when one did not, or none was probed."""
        answers = list(self._probed.values())
        if not answers or any(a.get(ALLOW_ORIGIN) != PROBE_ORIGIN for a in answers):
            return None
        return {**answers[0], ALLOW_ORIGIN: origin}

"""The proxy's own API keys (``api_key``), checked as llama-server checks ``--api-key``.

A request presents its key in ``Authorization`` (a ``Bearer `` prefix is optional) or, when
that header is absent, in ``X-Api-Key`` (``core.prompt.headers.presented_key``). Every path needs
one of the keys except the public ones: llama-server's ``/health``, ``/v1/health`` and ``/`` (with
the proxy's own ``/healthz`` and ``/readyz``, for the same health checks), ``/admin/*``
(its own ``admin_token``) and a CORS preflight (``OPTIONS``). A missing or wrong key is a
401 with llama-server's body. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy.core.prompt.headers import presented_key
from proxy.errors import InvalidApiKey

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_key_check(keys: tuple[str, ...], public: frozenset[str]) -> Middleware:
    allowed = [key.encode() for key in keys]

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "OPTIONS" and not _public(request.path, public):
            # the header's own bytes: a byte that is not UTF-8 cannot match, and is a 401 too
            given = presented_key(request.headers).encode("utf-8", "surrogateescape")
            if not any([hmac.compare_digest(given, key) for key in allowed]):
                raise InvalidApiKey
        return await handler(request)

    return check


def _public(path: str, public: frozenset[str]) -> bool:
    return path in public or path.startswith("/admin/")

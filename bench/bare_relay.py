"""The floor of a Python relay: an aiohttp server that posts each request body to one backend
and returns its answer, with no routing, parsing, metrics or logging. ``bench.peer_overhead``
runs it beside the proxy (``--floor``) so the proxy's added latency can be read against what
any aiohttp relay on the same machine adds.

    python -m bench.bare_relay BACKEND_URL PORT
"""

from __future__ import annotations

import sys

import aiohttp
from aiohttp import web

from proxy.cli import event_loop  # the proxy's own loop: the floor compares like with like

CLIENT = web.AppKey("client", aiohttp.ClientSession)


def app(backend: str) -> web.Application:
    async def start(app: web.Application) -> None:
        app[CLIENT] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stop(app: web.Application) -> None:
        await app[CLIENT].close()

    async def relay(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        async with request.app[CLIENT].post(
            backend + request.path, data=body, headers=headers
        ) as r:
            return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    application = web.Application()
    application.on_startup.append(start)
    application.on_cleanup.append(stop)
    application.router.add_post("/v1/chat/completions", relay)
    application.router.add_get("/readyz", ready)
    return application


def main() -> None:
    backend, port = sys.argv[1], int(sys.argv[2])
    web.run_app(
        app(backend), host="127.0.0.1", port=port, print=None, access_log=None, loop=event_loop()
    )


if __name__ == "__main__":
    main()

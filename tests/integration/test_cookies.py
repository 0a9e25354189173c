"""Cookies belong to clients: the proxy relays them and never keeps one for the next client."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from testbed.fake_llama import FakeLlamaServer


class CookieSettingServer(FakeLlamaServer):
    """A fake llama-server behind something that sets a cookie (an ingress's sticky-session
    cookie, an auth gateway's): every response sets one, and every request's Cookie header
    is recorded."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cookies: list[str | None] = []

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def cookies(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.path == "/v1/models":
                self.cookies.append(request.headers.get("Cookie"))
            response: web.StreamResponse = await handler(request)
            response.set_cookie("route", "backend-secret")
            return response

        app.middlewares.append(cookies)
        return app


async def test_a_cookie_a_backend_set_reaches_its_client_and_no_other(proxy: Any) -> None:
    backend = CookieSettingServer()
    await backend.start()
    try:
        # by name, as in a cluster (a cookie jar keeps no cookie of an IP address)
        client = await proxy([f"http://localhost:{backend.port}"])
        first = await client.get("/v1/models")
        assert first.status == 200
        assert first.cookies["route"].value == "backend-secret"  # relayed to its client
        client.session.cookie_jar.clear()  # the next request comes from another client
        assert (await client.get("/v1/models")).status == 200
        assert backend.cookies == [None, None]  # the proxy sent none of its own
    finally:
        await backend.stop()

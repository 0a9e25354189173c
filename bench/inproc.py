"""The proxy served in-process on a free loopback port, for benchmarks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config.settings import Settings
from testbed.stack import free_port


def with_address_headers(settings: Settings) -> Settings:
    """Benchmarks read X-Cache-Backend (an opt-in: ``routing.address_headers``)."""
    routing = settings.routing.model_copy(update={"address_headers": True})
    return settings.model_copy(update={"routing": routing})


@asynccontextmanager
async def serve(
    settings: Settings, registry: CollectorRegistry | None = None
) -> AsyncIterator[str]:
    """``async with serve(settings) as url``: the proxy's base URL while it runs (its metrics
    in ``registry`` when given)."""
    port = free_port()  # named in listen: a replica advertises it to its peers
    settings = with_address_headers(settings).model_copy(update={"listen": f"127.0.0.1:{port}"})
    app = create_app(settings, registry=registry or CollectorRegistry())
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()

"""The proxy served in-process on a free loopback port, for benchmarks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config import Settings


@asynccontextmanager
async def serve(
    settings: Settings, registry: CollectorRegistry | None = None
) -> AsyncIterator[str]:
    """``async with serve(settings) as url``: the proxy's base URL while it runs (its metrics
    in ``registry`` when given)."""
    app = create_app(settings, registry=registry or CollectorRegistry())
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()

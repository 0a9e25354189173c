"""The proxy's own status endpoints: liveness (``/healthz``: the process answers), readiness
(``/readyz``: some backend is ready, 503 otherwise) and Prometheus metrics (``/metrics``)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.core.fleet import BackendPhase, Fleet
from proxy.errors import ServiceUnavailable
from proxy.metrics import ProxyMetrics


class StatusHandlers:
    def __init__(self, fleet: Fleet, metrics: ProxyMetrics) -> None:
        self._fleet = fleet
        self._metrics = metrics

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        ready = [b.label for b in self._fleet.backends if b.phase is BackendPhase.READY]
        if not ready:
            raise ServiceUnavailable("no backend is ready", code="not_ready")
        return web.json_response({"status": "ready", "backends": ready})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

"""The proxy's own status endpoints: liveness (``/healthz``: the process answers), readiness
(``/readyz``: some backend is ready, 503 otherwise) and Prometheus metrics (``/metrics``).

llama-server's readiness endpoints (``upstream.HEALTH``) mean the same as ``/readyz`` in its
bytes: ``{"status":"ok"}`` when some backend is ready, else 503 ``Loading model``. ``refused``
answers the llama-server routes the proxy does not serve (``upstream.REFUSED``) with the
reason."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.core.fleet import BackendPhase, Fleet
from proxy.errors import LoadingModel, Refused, ServiceUnavailable
from proxy.metrics import ProxyMetrics
from proxy.upstream import REFUSED


class StatusHandlers:
    def __init__(self, fleet: Fleet, metrics: ProxyMetrics) -> None:
        self._fleet = fleet
        self._metrics = metrics

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def health(self, request: web.Request) -> web.Response:
        if not any(b.phase is BackendPhase.READY for b in self._fleet.backends):
            raise LoadingModel
        return web.Response(text='{"status":"ok"}', content_type="application/json")

    async def refused(self, request: web.Request) -> web.Response:
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else request.path
        reason = REFUSED[(request.method, path)]
        raise Refused(f"{request.method} {path} is not served through the proxy: {reason}")

    async def readyz(self, request: web.Request) -> web.Response:
        ready = [b.label for b in self._fleet.backends if b.phase is BackendPhase.READY]
        if not ready:
            raise ServiceUnavailable("no backend is ready", code="not_ready")
        return web.json_response({"status": "ready", "backends": ready})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

"""The proxy's own status endpoints: liveness (``/healthz``: the process answers), readiness
(``/readyz``: some backend is ready, 503 otherwise) and Prometheus metrics (``/metrics``): the
proxy's own, then each backend's llama-server metrics read at scrape time, concurrently
(``core.server.exposition``: verbatim from one backend, labelled ``backend`` from several; a backend
that does not answer 200 in time adds nothing), with the first ``Process-Start-Time-Unix``
a backend sent.

llama-server's readiness endpoints (``upstream.HEALTH``) mean the same as ``/readyz`` in its
bytes: ``{"status":"ok"}`` when some backend is ready, else 503 ``Loading model``. ``refused``
answers the llama-server routes the proxy does not serve (``upstream.REFUSED``) with the
reason."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.core.server.exposition import combine
from proxy.core.server.fleet import BackendPhase, Fleet
from proxy.errors import LoadingModel, Refused, ServiceUnavailable
from proxy.metrics import ProxyMetrics
from proxy.upstream import REFUSED, LlamaServerClient


class StatusHandlers:
    def __init__(
        self,
        fleet: Fleet,
        metrics: ProxyMetrics,
        client: LlamaServerClient,
        backends: Sequence[tuple[str, str]] = (),
    ) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self._client = client
        self._backends = backends  # (label, base URL) of each backend, in order

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
        headers = {"Content-Type": CONTENT_TYPE_LATEST}
        pages: list[tuple[str, str]] = []
        for (label, _), answer in zip(self._backends, await self._scrape(), strict=True):
            if answer is not None:
                pages.append((label, answer[0]))
                if answer[1] is not None:
                    headers.setdefault("Process-Start-Time-Unix", answer[1])
        theirs = combine(pages, labelled=len(self._backends) > 1)
        return web.Response(body=body + theirs.encode(), headers=headers)

    async def _scrape(self) -> list[tuple[str, str | None] | None]:
        """Each backend's metrics text and start time, or None (see ``upstream``)."""
        client = self._client
        return await asyncio.gather(*(client.metrics(url) for _, url in self._backends))

"""Admin endpoints: the slot table, the disk tier's status and prefix churn, behind a
bearer token; absent (404) without one."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from aiohttp import web

from proxy.config.settings import Settings
from proxy.core.server.fleet import Fleet
from proxy.disk.tier import DiskTier
from proxy.errors import NotFound, Unauthorized
from proxy.routing.churn_tracker import ChurnTracker


class AdminHandlers:
    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        clock: Callable[[], float],
        disk: DiskTier,
        churn: ChurnTracker,
    ) -> None:
        self._disk = disk
        self._churn = churn
        self._churn_text = settings.admin_churn_text  # prompt excerpts and session keys
        token = settings.admin_token
        self._token = token.get_secret_value() if token is not None else None
        self._fleet = fleet
        self._clock = clock

    def _check(self, request: web.Request) -> None:
        if self._token is None:
            raise NotFound("no such endpoint")
        # the header's own bytes: a byte that is not UTF-8 cannot match, and is a 401 too
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, f"Bearer {self._token}".encode()):
            raise Unauthorized("admin endpoints need 'Authorization: Bearer <admin_token>'")

    async def slots(self, request: web.Request) -> web.Response:
        self._check(request)
        now = self._clock()
        return web.json_response(
            {"backends": [self._backend(b, now) for b in self._fleet.backends]}
        )

    async def churn(self, request: web.Request) -> web.Response:
        """Where sessions' prompts stop extending their previous prompts (``report`` reads it)."""
        self._check(request)
        return web.json_response(self._churn.status(self._churn_text))

    async def disk(self, request: web.Request) -> web.Response:
        """Policy, per-backend layout and speeds, and the index: size, bytes, entries."""
        self._check(request)
        entries = await self._disk.index.all() or []
        disk, settings = self._disk, self._disk.settings.disk
        status: dict[str, Any] = {
            "policy": str(disk.default),
            "min_tokens": settings.min_tokens,
            "max_bytes": settings.max_bytes,
            "backends": [
                {
                    "label": self._fleet.backends[i].label,
                    "directory": disk.directory(i),
                    "supported": state.supported,
                    "layout": state.layout.__dict__ if state.layout else None,
                    "prefill_tokens_per_s": round(self._fleet.backends[i].prefill_tps, 1),
                    "restore_bytes_per_s": round(state.restore_bps),
                }
                for i, state in enumerate(disk.backends)
            ],
        }
        status["index"] = {
            "entries": len(entries),
            "bytes": sum(e.nbytes for e in entries),
            "bad": sum(1 for e in entries if e.bad),
            "snapshots": [
                {
                    "name": e.name,
                    "directory": e.directory,
                    "tokens": e.tokens,
                    "bytes": e.nbytes,
                    "hits": e.hits,
                    "bad": e.bad,
                    "last_used": e.last_used,
                }
                for e in sorted(entries, key=lambda e: -e.last_used)[:100]
            ],
        }
        return web.json_response(status)

    @staticmethod
    def _backend(backend: Any, now: float) -> dict[str, Any]:
        return {
            "label": backend.label,
            "phase": backend.phase.value,
            "epoch": backend.epoch,
            "exact_reuse_only": backend.exact,
            "slots": [
                {
                    "id": s.id,
                    "phase": s.phase.value,
                    "kv_tokens": s.n_tokens,
                    "segments": len(s.content.hashes) if s.content else 0,
                    "estimated_tokens": s.content.total if s.content else 0,
                    "idle_seconds": round(now - s.last_used, 3) if s.last_used else None,
                }
                for s in backend.slots
            ],
        }

"""Request id, in-flight accounting, error rendering and the one log line per request.

Every error leaves as OpenAI-shaped JSON (Anthropic-shaped on ``/v1/messages``, whose clients
expect that: ``core.request.anthropic_reply``): ``ProxyError`` as itself, aiohttp's own HTTP
errors (404, 413 from the body limit) mapped onto the same vocabulary (a method a path does
not take is a 404, as llama-server answers it, naming the methods it takes), and anything
unexpected as a 500 that names the request id (the traceback goes to the log, never to the
client). A request aiohttp cannot parse as HTTP never reaches the middleware: aiohttp
answers it 400 in plain text, and ``ProtocolLog`` logs it as one warning line.

The access line cannot be forged by a client: a client's ``X-Request-Id`` is kept only when
it is a plain token (``SAFE_ID``), else replaced by a fresh id, and every value that is not
plain printable ASCII without spaces or quotes (a path with ``%0a``) is logged as a JSON
string, escapes included. ``outcome`` says how the response ended: ``complete``,
``upstream_error`` (the backend failed after the status line was sent, which stays 200)
or ``client_gone``. The line is written on the event loop's next turn, after a non-streamed
response has left (and before any later request is read): the reply does not wait for it.
With ``log_format: json`` every log line is one JSON object (``JsonLogFormatter``), the access
line's fields as its keys.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Middleware

from proxy.config.sections import RoutingSettings
from proxy.core.prompt.usage import Usage
from proxy.core.request.anthropic_reply import error_body as anthropic_error
from proxy.errors import (
    InvalidRequest,
    LlamaShaped,
    NotFound,
    PayloadTooLarge,
    ProxyError,
)
from proxy.http.cors import CorsMirror
from proxy.metrics import ProxyMetrics
from proxy.upstream import ROUTES

log = logging.getLogger("proxy.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Ending(StrEnum):
    """How a response ended, for the access log's ``outcome``."""

    COMPLETE = "complete"
    UPSTREAM_ERROR = "upstream_error"  # the backend failed after the status line said 200
    PROXY_ERROR = "proxy_error"  # the proxy failed relaying an answer whose status line was sent
    CLIENT_GONE = "client_gone"  # the client left first (status 499)
    SHUTDOWN = "shutdown"  # the proxy stopped while the answer streamed (an error event ends it)


@dataclass
class RequestRecord:
    request_id: str
    started: float
    backend: str = "-"
    slot: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    route_s: float | None = None  # fingerprinting and planning, before asking for a slot
    outcome: Ending = Ending.COMPLETE
    queue_s: float | None = None  # from asking for a slot to holding one (decisions included)
    relayed: bool = False  # sent to the replica that served it, which counts it in requests
    rendered: bool = False  # answered with the proxy's own error (``render``)

    def server_timing(self) -> str:
        """The ``Server-Timing`` header (W3C; browsers' developer tools show it): ``route``,
        from the request's arrival to asking for a slot (reading it, fingerprinting,
        planning), and ``queue``, from asking for a slot to holding one, in milliseconds."""
        parts = (("route", self.route_s), ("queue", self.queue_s))
        return ", ".join(f"{name};dur={s * 1000:.1f}" for name, s in parts if s is not None)

    def route_headers(
        self, routing: RoutingSettings, planned: dict[str, str], replica: str | None
    ) -> dict[str, str]:
        """``X-Request-Id``; with ``route_headers`` also ``Server-Timing``, the plan's
        ``X-Cache-Route`` and ``-Predicted-Tokens`` (``planned``) and ``X-Cache-Slot``; with
        ``address_headers`` too, the internal names ``X-Cache-Backend`` and (shared state)
        ``X-Cache-Replica``, which is why they are opt-in."""
        headers = {"X-Request-Id": self.request_id}
        if not routing.route_headers:
            return headers
        if timing := self.server_timing():
            headers["Server-Timing"] = timing
        headers.update(planned)
        if routing.address_headers:
            headers["X-Cache-Backend"] = self.backend
            if replica is not None:
                headers["X-Cache-Replica"] = replica
        if self.slot is not None:
            headers["X-Cache-Slot"] = str(self.slot)
        return headers

    def counted(self, usage: Usage | None) -> None:
        """The response's usage, for the log line."""
        if usage is not None:
            self.prompt_tokens, self.cached_tokens = usage.prompt_tokens, usage.cached_tokens


class ProtocolLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's connection-level logger (``handler_args``). A request aiohttp cannot parse
    (a header line past its 8190 bytes, a ``Content-Encoding`` it cannot decode) is the
    client's error, answered 400 before any middleware runs: one warning line, no
    traceback. Anything else keeps its traceback."""

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            self.warning("malformed HTTP request answered %s: %s", exc.code, exc.message)
            return
        super().exception(msg, *args, **kwargs)


class JsonLogFormatter(logging.Formatter):
    """``log_format: json``: one JSON object per line; an access line's fields are its keys."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        line.update(fields if isinstance(fields, dict) else {"message": record.getMessage()})
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line)


RECORD = web.RequestKey("record", RequestRecord)
SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_PLAIN = re.compile(r"[!#-~]+")  # printable ASCII but space and double quote
_OWN = {"/healthz", "/readyz", "/metrics", "/admin/slots", "/admin/disk", "/admin/churn"}


def render(error: ProxyError, request_id: str, path: str = "") -> web.Response:
    route = ROUTES.get(path)
    text = error.text()  # (llama-server's own answers keep its shape on every path)
    if route and route.via and not isinstance(error, LlamaShaped):
        text = json.dumps(anthropic_error(error.status, error.message))
    response = web.Response(
        text=text, status=error.status, headers=error.headers, content_type="application/json"
    )
    response.headers["X-Proxy-Error"] = "1"
    response.headers["X-Request-Id"] = request_id
    if error.headers.get("Connection") == "close":
        response.force_close()  # the request's bytes cannot be trusted to end where it says
    return response


def _from_http(exc: web.HTTPException) -> ProxyError:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return PayloadTooLarge("request body is larger than the proxy accepts")
    if isinstance(exc, web.HTTPMethodNotAllowed):  # (llama-server: 404, File Not Found)
        allowed = ", ".join(sorted(exc.allowed_methods))
        return NotFound(f"no such endpoint for {exc.method}; this path takes {allowed}")
    if isinstance(exc, web.HTTPNotFound):
        return NotFound("no such endpoint")
    error = ProxyError(exc.reason or "error", code=str(exc.status))
    error.status = exc.status
    return error


def make_preflight(forward: Handler) -> Middleware:
    """``OPTIONS`` on any path goes to ``forward`` (llama-server answers a CORS preflight
    before its routes); every other method keeps the router's 404s."""

    @web.middleware
    async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await (forward if request.method == "OPTIONS" else handler)(request)

    return preflight


def make_middleware(
    metrics: ProxyMetrics, clock: Callable[[], float], cors: CorsMirror
) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = clock()
        request_id = request.headers.get("X-Request-Id", "")
        if not SAFE_ID.fullmatch(request_id):
            request_id = os.urandom(8).hex()
        record = RequestRecord(request_id, started)
        request[RECORD] = record
        endpoint = request.path if request.path in ROUTES or request.path in _OWN else "other"
        status = 499
        metrics.in_flight.inc()
        try:
            response = await _respond(request, handler, record)
            status = response.status
            origin = request.headers.get("Origin")
            if origin is not None:  # a browser's: the proxy's own answers as the backends'
                cors.answer(origin, response, record.backend != "-" and not record.rendered)
            return response
        finally:  # a cancelled handler (client gone) is logged as 499
            metrics.in_flight.dec()
            elapsed = clock() - started
            if not record.relayed:  # (counted by the replica that served it: once a fleet)
                metrics.requests.labels(endpoint, str(status)).inc()
                metrics.duration.labels(endpoint).observe(elapsed)
            if status == 499:
                record.outcome = Ending.CLIENT_GONE
            if log.isEnabledFor(logging.INFO):  # written once the response has left
                asyncio.get_running_loop().call_soon(_log, request, record, status, elapsed)

    return middleware


async def _respond(
    request: web.Request, handler: Handler, record: RequestRecord
) -> web.StreamResponse:
    try:
        response = await handler(request)
    except ProxyError as exc:
        error: ProxyError = exc
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = _from_http(exc)
    except RecursionError:  # (a body the decoder took, nested too deeply for its encoding)
        error = InvalidRequest("request body is nested too deeply", code="invalid_json")
    except Exception:
        if request.transport is None or request.transport.is_closing():
            return web.Response(status=499)  # the client left: nobody to answer, no traceback
        log.exception("request_id=%s unexpected error", record.request_id)
        error = ProxyError(f"internal proxy error (request id {record.request_id})")
    else:
        if not response.prepared:
            response.headers["X-Request-Id"] = record.request_id
        return response
    record.rendered = True
    return render(error, record.request_id, request.path)


def _log(request: web.Request, record: RequestRecord, status: int, elapsed: float) -> None:
    queue_ms = None if record.queue_s is None else round(record.queue_s * 1000, 1)
    fields = {
        "request_id": record.request_id,
        "method": request.method,
        "path": request.path,
        "backend": record.backend,
        "slot": record.slot,
        "status": status,
        "outcome": record.outcome,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "queue_ms": queue_ms,
        "ms": round(elapsed * 1000, 1),
    }
    line = " ".join(f"{name}={log_value(value)}" for name, value in fields.items())
    log.info("%s", line, extra={"fields": fields})


def log_value(value: object) -> str:
    """A value for a ``key=value`` log line: as is when plain, else a JSON string."""
    if value is None:
        return "-"
    if type(value) is int or type(value) is float:
        return str(value)  # (plain: digits, a sign, a point, an exponent, inf or nan)
    text = str(value)
    return text if _PLAIN.fullmatch(text) else json.dumps(text)

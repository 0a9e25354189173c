"""The proxy's one error vocabulary, rendered in OpenAI's error shape.

    ProxyError                      (status, OpenAI type, code, message, headers)
    ├── InvalidRequest              400  malformed JSON, wrong field types
    ├── NotFound                    404  path (or method on it) the proxy does not serve
    ├── Unauthorized                401  admin endpoints without the bearer token
    ├── Refused                     403  a llama-server route the proxy does not serve, and why
    ├── PayloadTooLarge             413  body over ``max_body_bytes`` (closes the connection)
    ├── UnsupportedEncoding         415  body with a Content-Encoding (closes the connection)
    ├── InvalidApiKey, LoadingModel 401, 503  llama-server's own answers, in its bytes
    ├── ServiceUnavailable          503  no ready backend / queue full / wait too long (Retry-After)
    ├── BadGateway                  502  backend failed before answering
    └── GatewayTimeout              504  backend silent past the read timeout

Upstream llama-server error bodies are already OpenAI-shaped and pass through unchanged;
errors the proxy itself originates carry the header ``X-Proxy-Error: 1``. Where the proxy
answers in llama-server's place (a wrong API key, ``/health`` while no backend is ready),
``LlamaShaped`` errors carry llama-server's own bytes.
No aiohttp import here: the middleware does the rendering.
"""

from __future__ import annotations

import json
from typing import Any


class ProxyError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)

    def text(self) -> str:
        return json.dumps(self.body())


class LlamaShaped(ProxyError):
    """An answer llama-server gives itself, in its bytes: compact JSON, its keys in its order
    (``message``, ``type``, then the status as ``code``)."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.status}}

    def text(self) -> str:
        return json.dumps(self.body(), separators=(",", ":"))


class InvalidApiKey(LlamaShaped):
    status = 401
    type = "authentication_error"

    def __init__(self) -> None:
        super().__init__("Invalid API Key")


class LoadingModel(LlamaShaped):
    """``/health`` while no backend is ready."""

    status = 503
    type = "unavailable_error"

    def __init__(self) -> None:
        super().__init__("Loading model")


class InvalidRequest(ProxyError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class UnreadableBody(InvalidRequest):
    """A body whose bytes do not follow its Content-Encoding or Transfer-Encoding. The
    connection closes after the answer: where the next request's bytes start is unknown."""

    code = "invalid_encoding"

    def __init__(self) -> None:
        message = (
            "request body could not be read: its bytes do not follow its Content-Encoding or "
            "Transfer-Encoding"
        )
        super().__init__(message, headers={"Connection": "close"})


class Unauthorized(ProxyError):
    status = 401
    type = "authentication_error"
    code = "unauthorized"


class Refused(ProxyError):
    """A route llama-server serves that the proxy refuses on purpose (the message says why)."""

    status = 403
    type = "feature_disabled"
    code = "refused_by_proxy"


class NotFound(ProxyError):
    status = 404
    type = "not_found_error"
    code = "not_found"


class RequestTimeout(ProxyError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(ProxyError):
    """The connection closes after the answer: the rest of the body is not read."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Connection": "close"})


class UnsupportedEncoding(ProxyError):
    """A body with a ``Content-Encoding`` (gzip, deflate, br, zstd), refused unread as
    llama-server refuses it; the connection closes after the answer."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_encoding"

    def __init__(self) -> None:
        message = "request body must not be encoded (Content-Encoding), as llama-server requires"
        super().__init__(message, headers={"Connection": "close"})


class ServiceUnavailable(ProxyError):
    status = 503
    type = "unavailable_error"
    code = "service_unavailable"


class BadGateway(ProxyError):
    status = 502
    type = "server_error"
    code = "bad_gateway"


class GatewayTimeout(ProxyError):
    status = 504
    type = "server_error"
    code = "upstream_timeout"


def error_body(
    message: str, type_: str, code: str | int, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse_error_event(error: ProxyError) -> bytes:
    """The event that ends a stream which failed after its first byte."""
    return b"data: " + json.dumps(error.body()).encode() + b"\n\n"

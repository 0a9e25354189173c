"""Header values the proxy reads itself: bytes that are not UTF-8 get a 4xx in the OpenAI
error shape, never a 500 with a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from tests.conftest import chat

BAD = b"\xff\xfe"  # not UTF-8


async def raw_request(
    client: Any, method: str, path: str, headers: bytes, body: bytes = b""
) -> tuple[int, bytes]:
    """Sends one request with ``headers`` as raw bytes; the status and the body."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    head = f"{method} {path} HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
    length = f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    writer.write(head.encode() + headers + b"\r\n" + length.encode() + body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_admin_token_that_is_not_utf8_is_a_401(
    fakes: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client = await proxy([await fakes()], admin_token="s3cret")
    status, body = await raw_request(client, "GET", "/admin/slots", b"Authorization: Bearer " + BAD)
    assert status == 401
    assert json.loads(body)["error"]["type"] == "authentication_error"
    assert _errors(caplog) == []


@pytest.mark.parametrize(
    ("isolation", "header"),
    [
        ({"mode": "tenant"}, b"Authorization: Bearer " + BAD),
        ({"mode": "tenant", "tenant_header": "X-Tenant"}, b"X-Tenant: " + BAD),
    ],
    ids=["bearer-key", "tenant-header"],
)
async def test_tenant_that_is_not_utf8_is_a_400(
    fakes: Any,
    proxy: Any,
    caplog: pytest.LogCaptureFixture,
    isolation: dict[str, Any],
    header: bytes,
) -> None:
    fake = await fakes()
    client = await proxy([fake], isolation=isolation)
    body = json.dumps(chat("hello", max_tokens=2)).encode()
    status, answer = await raw_request(client, "POST", "/v1/chat/completions", header, body)
    assert status == 400
    error = json.loads(answer)["error"]
    assert error["code"] == "invalid_header"
    assert "not valid UTF-8" in error["message"]
    assert _errors(caplog) == []
    assert fake.received == []


async def test_session_header_that_is_not_utf8_is_a_400_with_redis(
    fakes: Any, proxy: Any, redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake = await fakes()
    client = await proxy([fake], redis_url=redis_server.url)
    body = json.dumps(chat("hello", max_tokens=2)).encode()
    status, answer = await raw_request(
        client, "POST", "/v1/chat/completions", b"X-Session-Id: " + BAD, body
    )
    assert status == 400
    assert json.loads(answer)["error"]["param"].lower() == "x-session-id"
    assert _errors(caplog) == []
    # a header the proxy only relays keeps its bytes and works as before
    status, _ = await raw_request(client, "POST", "/v1/chat/completions", b"X-Other: " + BAD, body)
    assert status == 200

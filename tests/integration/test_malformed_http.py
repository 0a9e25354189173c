"""Requests aiohttp cannot parse as HTTP: answered 400 before the app, logged as one line."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.conftest import chat


@pytest.mark.parametrize(
    ("headers", "says"),
    [({"X-Big": "x" * 9000}, "8190")],
    ids=["long-header"],
)
async def test_malformed_http_is_a_400_logged_without_a_traceback(
    fakes: Any, proxy: Any, caplog: pytest.LogCaptureFixture, headers: dict[str, str], says: str
) -> None:
    fake = await fakes()
    client = await proxy([fake])
    body = chat("hello", max_tokens=2)
    with caplog.at_level(logging.WARNING, logger="aiohttp.server"):
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status == 400
        assert says in await resp.text()  # aiohttp's own plain-text answer names the cause
    logged = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert [r.levelno for r in logged] == [logging.WARNING]
    assert logged[0].exc_info is None
    assert "malformed HTTP request answered 400" in logged[0].getMessage()
    assert fake.received == []
    again = await client.post("/v1/chat/completions", json=body)  # the proxy serves on
    assert again.status == 200


async def test_the_parser_takes_what_llama_servers_takes(fakes: Any, proxy: Any) -> None:
    """A request line of up to 32,766 bytes (a long query string) and up to 100 header lines
    are answered, as llama-server answers them; one header more is a 400, as there."""
    client = await proxy([await fakes()])
    target = "/health?x=" + "a" * (32766 - len("GET /health?x= HTTP/1.1"))
    assert (await client.get(target)).status == 200
    assert (await client.get(target + "a")).status == 400  # (llama-server: no answer)
    # (the test client adds Host, Accept, Accept-Encoding and User-Agent)
    many = {f"X-{i}": "a" for i in range(96)}
    assert (await client.get("/health", headers=many)).status == 200
    assert (await client.get("/health", headers={**many, "X-96": "a"})).status == 400

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

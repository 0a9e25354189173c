"""Prefix-churn diagnostics end to end: admin endpoint, metrics and the report command."""

from __future__ import annotations

import asyncio
import io
from typing import Any

import pytest

from proxy.report import run_report
from testbed.probes import metric


def turn(clock: str, n: int) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": f"You are an agent. Current time: {clock}. " + "rule " * 60},
        {"role": "user", "content": "task seven: fix the build"},
    ]
    for i in range(n):
        messages += [
            {"role": "assistant", "content": f"step {i} done"},
            {"role": "user", "content": f"next {i}"},
        ]
    return {"messages": messages, "max_tokens": 4}


async def test_a_changing_timestamp_is_reported_where_it_churns(
    fakes: Any, proxy: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = await fakes(n_slots=2)
    client = await proxy([fake], admin_token="t", admin_churn_text=True)
    for i, clock in enumerate(["09:12:36", "09:12:51", "09:13:07"]):
        assert (await client.post("/v1/chat/completions", json=turn(clock, i))).status == 200
    status = await (await client.get("/admin/churn", headers={"Authorization": "Bearer t"})).json()
    assert status["where"] == {"0 system": 2}
    (top,) = status["top_sessions"]
    assert top["divergences"] == 2
    assert top["tokens_lost"] > 100
    assert "09:12:51" in status["recent"][-1]["before"]
    assert "09:13:07" in status["recent"][-1]["after"]
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_prefix_divergences_total", message="0") == 2
    out = io.StringIO()
    url = str(client.make_url("/")).rstrip("/")
    assert await asyncio.to_thread(run_report, url, "t", out) == 0
    text = out.getvalue()
    assert "message 0 system" in text
    assert "09:13:07" in text
    assert await asyncio.to_thread(run_report, url, None, io.StringIO()) == 2  # no token
    assert "answered 401 (give the proxy's admin_token" in capsys.readouterr().err
    bare = await proxy([fake])  # no admin_token: its admin endpoints are off
    url = str(bare.make_url("/")).rstrip("/")
    assert await asyncio.to_thread(run_report, url, "t", io.StringIO()) == 2
    assert "answered 404 (the proxy runs without admin_token" in capsys.readouterr().err


async def test_churn_shows_no_prompt_text_or_session_key_by_default(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=2)
    client = await proxy([fake], admin_token="t")
    for i, clock in enumerate(["09:12:36", "09:12:51"]):
        body = {**turn(clock, i), "prompt_cache_key": "alice@example.com"}
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
    answer = await client.get("/admin/churn", headers={"Authorization": "Bearer t"})
    status, text = await answer.json(), await answer.text()
    assert status["where"] == {"0 system": 1}  # the diagnosis stays
    assert "09:12" not in text
    assert "alice" not in text
    assert "rule" not in text
    (top,) = status["top_sessions"]
    assert top["session"].startswith("key-hash:")
    assert status["recent"][-1]["session"] == top["session"]


async def test_the_report_of_something_that_is_not_the_proxy_is_one_line(
    aiohttp_server: Any, capsys: Any
) -> None:
    from aiohttp import web

    async def churn(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})  # (JSON, but not the proxy's)

    app = web.Application()
    app.router.add_get("/admin/churn", churn)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    assert await asyncio.to_thread(run_report, url, None, io.StringIO()) == 2
    assert "not a llama-cache-proxy" in capsys.readouterr().err

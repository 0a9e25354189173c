"""llama-server's own Prometheus metrics read through the proxy's ``/metrics`` equal the
server's, after a completion through the proxy (one backend: its samples verbatim)."""

from __future__ import annotations

from typing import Any

import aiohttp

from testbed.probes import metric
from tests.real.test_real_llama_compat import _until_ready


async def test_prompt_tokens_through_the_proxy_equal_the_servers(
    llama_servers: Any, proxy: Any
) -> None:
    server = llama_servers(slots=1)
    client = await proxy([server.url])
    await _until_ready(client)
    body = {"prompt": "the quick brown fox jumps over the lazy dog", "n_predict": 4}
    resp = await client.post("/completion", json=body)
    assert resp.status == 200
    prompt_n = (await resp.json())["timings"]["prompt_n"]
    proxied = await client.get("/metrics")
    page = await proxied.text()
    async with aiohttp.ClientSession() as session, session.get(server.url + "/metrics") as own:
        direct = await own.text()
        assert proxied.headers["Process-Start-Time-Unix"] == own.headers["Process-Start-Time-Unix"]
    assert prompt_n > 0
    assert metric(page, "llamacpp:prompt_tokens_total") == prompt_n
    assert metric(page, "llamacpp:prompt_tokens_total") == metric(
        direct, "llamacpp:prompt_tokens_total"
    )
    assert "# TYPE llamacpp:prompt_tokens_total counter" in page

"""The request path's connections to a real llama-server (``proxy.upstream_http``): kept
alive and reused, and given up when the server ends them (its HTTP library closes a
connection after 100 requests, saying so in the last answer)."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.waiting import scrape, until_ready

OPENED = "llama_cache_proxy_upstream_connections_total"


async def test_one_connection_serves_requests_until_the_server_ends_it(
    llama_servers: Any, proxy: Any
) -> None:
    server = llama_servers(slots=2)
    client = await proxy([server.url])
    await until_ready(client, within=30.0)
    async with aiohttp.ClientSession() as direct:
        for i in range(120):  # past the server's 100 requests on one connection
            body = {"content": f"request {i}: the quick brown fox"}
            resp = await client.post("/tokenize", json=body)
            assert resp.status == 200, await resp.text()
            if i % 30 == 0 or i >= 99:  # (the ones around the server's close, and a few more)
                async with direct.post(server.url + "/tokenize", json=body) as expected:
                    assert await resp.json() == await expected.json()
        completion = {"prompt": "Hello", "n_predict": 2, "temperature": 0}
        assert (await client.post("/completion", json=completion)).status == 200
    # the first connection ended at its 100th answer, the second carries the rest
    assert await scrape(client, OPENED) == 2

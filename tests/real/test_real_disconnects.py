"""1,000 streams through the proxy process, clients vanishing at random points: every
upstream request ends, every slot is released, the gauges return to zero (fake
llama-servers as processes, so their slot state can be read back over HTTP)."""

from __future__ import annotations

import asyncio
import random

import aiohttp

from testbed.probes import metric
from testbed.stack import ProxyProcess, wait_http

AUTH = {"Authorization": "Bearer t"}


async def test_random_disconnects_of_1000_streams(fake_processes: list[str]) -> None:
    env = {"LLAMA_CACHE_PROXY_ADMIN_TOKEN": "t", "LLAMA_CACHE_PROXY_QUEUE__MAX_WAIT_SECONDS": "60"}
    proxy = ProxyProcess(fake_processes, env=env).start()
    try:
        wait_http(proxy.url + "/readyz", 30, proxy.proc)
        rng = random.Random(11)
        outcomes = {"complete": 0, "aborted": 0}
        url = proxy.url + "/v1/chat/completions"

        async def one(session: aiohttp.ClientSession, i: int) -> None:
            text = f"stream {i} " + "word " * rng.randint(1, 60)
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 20}
            cut = rng.choice([-1, 0, 1, 3, 8, 15, 100])  # -1: before the response arrives
            if cut == -1:
                task = asyncio.ensure_future(session.post(url, json={**body, "stream": True}))
                await asyncio.sleep(rng.random() * 0.02)
                task.cancel()
                outcomes["aborted"] += 1
                return
            async with session.post(url, json={**body, "stream": True}) as resp:
                assert resp.status == 200
                chunks = 0
                async for _ in resp.content:
                    chunks += 1
                    if chunks == cut:
                        resp.close()
                        outcomes["aborted"] += 1
                        return
                outcomes["complete"] += 1

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            pending: set[asyncio.Task[None]] = set()
            for i in range(1000):
                pending.add(asyncio.create_task(one(session, i)))
                if len(pending) >= 40:
                    _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.gather(*pending, return_exceptions=True)
            assert sum(outcomes.values()) == 1000
            assert outcomes["aborted"] > 300
            for _ in range(100):  # aborted slots drain (llama-server polls the socket)
                upstream_busy = False
                for fake in fake_processes:
                    async with session.get(fake + "/slots") as resp:
                        upstream_busy |= any(s["is_processing"] for s in await resp.json())
                async with session.get(proxy.url + "/admin/slots", headers=AUTH) as resp:
                    table = await resp.json()
                phases = {s["phase"] for b in table["backends"] for s in b["slots"]}
                if phases == {"idle"} and not upstream_busy:
                    break
                await asyncio.sleep(0.1)
            assert not upstream_busy  # every upstream request ended
            assert phases == {"idle"}  # every slot released
            for fake in fake_processes:
                async with session.get(fake + "/debug/violations") as resp:
                    assert (await resp.json())["violations"] == []
            async with session.get(proxy.url + "/metrics") as resp:
                page = await resp.text()
            assert metric(page, "llama_cache_proxy_requests_in_flight") == 1  # this scrape
            assert metric(page, "llama_cache_proxy_requests_queued") == 0
    finally:
        proxy.stop()

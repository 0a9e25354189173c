"""Clients that vanish at random points of 1,000 streams: nothing stays claimed or counted."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp

from tests.conftest import chat, metric


async def test_random_disconnects_of_1000_streams_release_everything(
    fakes: Any, proxy: Any
) -> None:
    backends = [
        await fakes(n_slots=4, gen_s_per_token=0.002, abort_release_s=0.05) for _ in range(2)
    ]
    client = await proxy(backends, admin_token="t", queue={"max_wait_seconds": 30})
    url = str(client.make_url("/v1/chat/completions"))
    rng = random.Random(7)
    outcomes = {"complete": 0, "aborted": 0, "503": 0}

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        body = chat(f"stream {i} " + "word " * rng.randint(1, 60), stream=True, max_tokens=20)
        cut = rng.choice([-1, 0, 1, 3, 8, 15, 100])  # -1: before the response arrives
        try:
            request = session.post(url, json=body)
            if cut == -1:
                task = asyncio.ensure_future(request)
                await asyncio.sleep(rng.random() * 0.02)
                task.cancel()
                outcomes["aborted"] += 1
                return
            async with request as resp:
                if resp.status == 503:
                    outcomes["503"] += 1
                    return
                assert resp.status == 200
                chunks = 0
                async for _ in resp.content:
                    chunks += 1
                    if chunks == cut:
                        resp.close()
                        outcomes["aborted"] += 1
                        return
                outcomes["complete"] += 1
        except asyncio.CancelledError:
            outcomes["aborted"] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        pending = set()
        for i in range(1000):
            pending.add(asyncio.create_task(one(session, i)))
            if len(pending) >= 40:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*pending, return_exceptions=True)
    assert sum(outcomes.values()) == 1000
    assert outcomes["aborted"] > 300
    assert outcomes["complete"] > 100
    # every upstream request ended: no fake slot busy, every proxy slot idle again
    for _ in range(100):
        table = await (
            await client.get("/admin/slots", headers={"Authorization": "Bearer t"})
        ).json()
        phases = {s["phase"] for b in table["backends"] for s in b["slots"]}
        if phases == {"idle"} and not any(s.busy for f in backends for s in f.slots):
            break
        await asyncio.sleep(0.05)
    assert phases == {"idle"}
    assert not any(s.busy for f in backends for s in f.slots)
    assert all(f.violations == [] for f in backends)  # never pinned a busy slot
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_requests_in_flight") == 1  # this scrape
    assert metric(page, "llama_cache_proxy_requests_queued") == 0

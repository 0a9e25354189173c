"""A client that gives up, and a proxy that is stopped, free the real llama-server's slot at
once: the server cancels a task when its connection closes, checking a waiting request's
connection only after a second with no task result (the proxy's polling leaves it that). The
server keeps what it computed of the cancelled task, and so does the proxy's view of it."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import aiohttp
import pytest

from testbed.probes import server_metric
from testbed.stack import ProxyProcess, wait_http

AUTH = {"Authorization": "Bearer t"}
# a generation of minutes on a CPU: whatever frees its slot within seconds cancelled it
ENDLESS = {"prompt": "I believe the meaning of life is", "n_predict": 2000, "ignore_eos": True}


async def _phases(client: Any) -> set[str]:
    table = await (await client.get("/admin/slots", headers=AUTH)).json()
    return {slot["phase"] for backend in table["backends"] for slot in backend["slots"]}


async def test_client_gone_before_headers_frees_the_backend_slot(
    llama_servers: Any, proxy: Any
) -> None:
    server = llama_servers(slots=1)
    client = await proxy([server.url], admin_token="t")
    async with aiohttp.ClientSession() as session:
        url, timeout = str(client.make_url("/completion")), aiohttp.ClientTimeout(total=0.1)
        with pytest.raises(TimeoutError):
            await session.post(url, json=ENDLESS, timeout=timeout)
        # the proxy's view, read without touching the server: each /slots call would put off
        # the server's connection check by a second
        for _ in range(50):  # 5 s
            if await _phases(client) == {"idle"}:
                break
            await asyncio.sleep(0.1)
        assert await _phases(client) == {"idle"}
        async with session.get(server.url + "/slots") as resp:
            assert [slot["is_processing"] for slot in await resp.json()] == [False]


async def _drained(client: Any) -> None:
    for _ in range(100):  # 10 s: the server frees a cancelled task within a second
        if await _phases(client) == {"idle"}:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"slots still {await _phases(client)}")


async def test_a_turn_cut_short_leaves_its_prompt_for_the_next_turn(
    llama_servers: Any, proxy: Any
) -> None:
    """A client interrupts a streamed answer, then sends its next turn: llama-server kept the
    prompt's KV, and the proxy pins the turn to that slot: the server computes only the new
    tokens, counting any warm-up the proxy sends first (no RAM cache, which would bring the
    prompt back into any slot)."""
    server = llama_servers(slots=2, extra=["--cache-ram", "0"])
    client = await proxy([server.url], admin_token="t")
    question = " ".join(f"Item {i}: the {i}th entry of the inventory list." for i in range(60))
    first = [{"role": "user", "content": question}]
    body = {"messages": first, "max_tokens": 400, "stream": True, "temperature": 0}
    async with client.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if b'"content"' in line:  # the prompt is in the KV: the answer has begun
                break
        resp.close()
    await _drained(client)
    computed = server_metric(server.url, "llamacpp:prompt_tokens_total")
    turn = [*first, {"role": "assistant", "content": "Item"}, {"role": "user", "content": "Go on."}]
    body = {"messages": turn, "max_tokens": 4, "temperature": 0}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    answer = await resp.json()
    computed = server_metric(server.url, "llamacpp:prompt_tokens_total") - computed
    prompt = answer["usage"]["prompt_tokens"]
    assert prompt > 600
    assert computed <= 0.1 * prompt, (computed, prompt)


async def test_sigterm_stops_the_proxy_promptly_with_a_request_in_flight(
    llama_servers: Any,
) -> None:
    server = llama_servers(slots=1)
    proxy = ProxyProcess([server.url]).start()
    try:
        wait_http(proxy.url + "/readyz", 30, proxy.proc)
        async with aiohttp.ClientSession() as session:
            request = asyncio.ensure_future(session.post(proxy.url + "/completion", json=ENDLESS))
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:  # until the server runs it
                async with session.get(server.url + "/slots") as resp:
                    if (await resp.json())[0]["is_processing"]:
                        break
                await asyncio.sleep(0.1)
            assert proxy.proc is not None
            stopped = time.monotonic()
            proxy.proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proxy.proc.wait, 20)
            assert time.monotonic() - stopped < 2.0  # not once the generation ended
            with pytest.raises(aiohttp.ClientError):
                await request
    finally:
        proxy.stop(kill=True)

"""Two and four proxy processes on one real Redis: a slot is never pinned twice at once, and
the leases of a replica that is killed expire (fake llama-servers as processes, so their
record of busy-slot pins can be read back)."""

from __future__ import annotations

import asyncio
import signal
from functools import partial
from typing import Any

import aiohttp
import pytest
import redis

from testbed.probes import until_listed
from testbed.stack import ProxyProcess, wait_http
from tests.waiting import ADMIN, admin_view, until, until_metric

TTL = "2"


def body(i: int, tokens: int = 12) -> dict[str, Any]:
    text = f"replica test {i} " + "word " * (i % 7)
    return {"messages": [{"role": "user", "content": text}], "max_tokens": tokens, "stream": True}


async def stream(session: aiohttp.ClientSession, url: str, i: int, tokens: int = 12) -> int:
    via = {"X-Test-Via": url}
    async with session.post(
        url + "/v1/chat/completions", json=body(i, tokens), headers=via
    ) as resp:
        await resp.read()
        return resp.status


@pytest.mark.parametrize("replicas", [2, 4])
async def test_replicas_never_pin_a_slot_twice_and_dead_leases_expire(
    fake_processes: list[str], redis_server: Any, replicas: int
) -> None:
    env = {"LLAMA_CACHE_PROXY_ROUTING__LEASE_TTL_SECONDS": TTL}
    proxies = [
        ProxyProcess(fake_processes, redis_url=redis_server.url, env=env).start()
        for _ in range(replicas)
    ]
    try:
        for proxy in proxies:
            wait_http(proxy.url + "/readyz", 30, proxy.proc)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            statuses = await asyncio.gather(
                *(stream(session, proxies[i % replicas].url, i) for i in range(96))
            )
            assert statuses == [200] * 96
            for url in fake_processes:
                async with session.get(url + "/debug/violations") as resp:
                    assert (await resp.json())["violations"] == []
            # a replica dies while holding leases on busy slots
            held = [
                asyncio.create_task(stream(session, proxies[0].url, 1000 + i, 200))
                for i in range(4)
            ]
            store = redis.Redis.from_url(redis_server.url)
            for _ in range(60):  # placed once a slot is free of holds for earlier sessions
                if store.keys("llp:v1:lease:*"):
                    break
                await asyncio.sleep(0.05)
            assert store.keys("llp:v1:lease:*")  # the victim's leases
            proxies[0].stop(kill=True)
            await asyncio.gather(*held, return_exceptions=True)
            # they expire: nothing leaked
            await until(lambda: not store.keys("llp:v1:lease:*"), "leases expire", float(TTL) + 10)
            # the survivors can use every slot again
            statuses = await asyncio.gather(
                *(stream(session, proxies[-1].url, 2000 + i) for i in range(16))
            )
            assert statuses == [200] * 16
            store.close()
    finally:
        for proxy in proxies:
            proxy.stop()


async def test_a_frozen_replicas_expired_lease_frees_no_slot_still_running(
    slow_fake_processes: list[str], redis_server: Any
) -> None:
    """A replica freezes (SIGSTOP) while its requests run: their connections stay open, so the
    servers keep generating past the leases' expiry and the fence of its part. The other
    replica pins none of those slots until a ``/slots`` read shows it idle (the fakes record
    every pin of a busy slot), and serves its own requests once they are."""
    env = {"LLAMA_CACHE_PROXY_ROUTING__LEASE_TTL_SECONDS": TTL}
    fakes = slow_fake_processes
    a, b = (ProxyProcess(fakes, redis_url=redis_server.url, env=env) for _ in "ab")
    a.start()
    b.start()
    try:
        for proxy in (a, b):
            wait_http(proxy.url + "/readyz", 30, proxy.proc)
        await until_listed([a.url, b.url])
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            # 8 generations of 15 s on the 8 slots, through replica a
            url = a.url + "/v1/chat/completions"
            long = {"max_tokens": 256}
            held = [
                asyncio.create_task(session.post(url, json={**body(3000 + i), **long}))
                for i in range(8)
            ]
            store = redis.Redis.from_url(redis_server.url)

            def leases() -> set[bytes | str]:  # the replicas holding leases
                return {o for o in map(store.get, store.keys("llp:v1:lease:*")) if o is not None}

            await until(lambda: len(store.keys("llp:v1:lease:*")) >= 4, "the requests run", 10)
            owners = leases()  # a's, and b's for requests a relayed to it
            assert a.proc is not None
            a.proc.send_signal(signal.SIGSTOP)
            await until(lambda: not owners <= leases(), "the frozen replica's leases expire", 10)
            served = (stream(session, b.url, 4000 + i, 2) for i in range(8))
            statuses = await asyncio.gather(*served)
            assert statuses == [200] * 8
            for url in fakes:
                async with session.get(url + "/debug/violations") as resp:
                    assert (await resp.json())["violations"] == []
            for task in held:
                task.cancel()
            for answer in await asyncio.gather(*held, return_exceptions=True):
                if isinstance(answer, aiohttp.ClientResponse):
                    answer.close()  # (else its connection is collected unclosed, later)
            store.close()
    finally:
        if a.proc is not None:
            a.proc.send_signal(signal.SIGCONT)
        a.stop(kill=True)
        b.stop()


async def settled(client: Any, server: Any) -> bool:
    """No slot of ``server`` drains in the view of the replica behind ``client``."""
    return all(s["phase"] != "draining" for s in (await admin_view(client, server))["slots"])


async def test_replicas_that_lose_redis_split_a_real_servers_slots(
    llama_servers: Any, proxy: Any, redis_server: Any
) -> None:
    """Two replicas on one real llama-server (4 slots) and one real Redis; Redis stops:
    each replica pins only its own part of the slots (heartbeats told them of each other),
    so concurrent requests through both never share a slot, and all are served."""
    server = llama_servers(slots=4)
    patient = {"max_wait_seconds": 60.0}  # the second four wait for the first: on a busy CPU
    # that outlasts the tests' 5 s bound, which this test is not about
    urls, options = [server.url], {"admin_token": ADMIN, "queue": patient}
    pair = [await proxy(urls, redis_url=redis_server.url, **options) for _ in "ab"]
    a, b = pair
    await until_listed([str(c.make_url("")).rstrip("/") for c in pair])  # each read the other
    redis_server.stop()
    for client in pair:  # each has seen the outage and drained what it may not pin
        await until_metric(client, "llama_cache_proxy_state_store_up", lambda n: n == 0)
        await until(partial(settled, client, server), "the replica drains after the outage")
    bodies = [
        {"messages": [{"role": "user", "content": f"Say hello number {i}."}], "max_tokens": 16}
        for i in range(8)
    ]
    responses = await asyncio.gather(
        *((a, b)[i % 2].post("/v1/chat/completions", json=body) for i, body in enumerate(bodies))
    )
    assert [r.status for r in responses] == [200] * 8
    slots = [{r.headers["X-Cache-Slot"] for r in responses[side::2]} for side in (0, 1)]
    assert slots[0]
    assert slots[1]
    assert slots[0].isdisjoint(slots[1]), slots


async def test_replicas_back_from_a_redis_restart_do_not_report_each_other_lapsed(
    llama_servers: Any, proxy: Any, redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis restarts empty: the first replica back read a heartbeat list without the other,
    which reconnects a maintenance round later, and reported it as lapsed (a log line and
    the ReplicaLapsed alert after every restart). The fence still acts at once; it is
    reported only when the peer stays away. Both serve before, during and after."""
    server = llama_servers(slots=2)
    pair = [await proxy([server.url], redis_url=redis_server.url) for _ in range(2)]
    for client in pair:  # heartbeats: each has read the other
        await until_metric(client, "llama_cache_proxy_replicas_live", lambda n: n >= 2)
    redis_server.stop()
    for client in pair:  # both noticed the outage
        await until_metric(client, "llama_cache_proxy_state_store_up", lambda n: n == 0)
    redis_server.start()
    fenced = []
    for _ in range(30):  # 3 s: both reconnect and beat several times
        for client in pair:
            text = await (await client.get("/metrics")).text()
            gauge = "llama_cache_proxy_replicas_fenced "
            line = next(x for x in text.splitlines() if x.startswith(gauge))
            fenced.append(float(line.split()[-1]))
        await asyncio.sleep(0.1)
    assert fenced
    assert max(fenced) == 0
    assert "lapsed" not in caplog.text
    assert "state store back" in caplog.text
    for i, client in enumerate(pair):
        resp = await client.post("/v1/chat/completions", json=body(i, 4))
        assert resp.status == 200

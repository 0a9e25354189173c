"""Faults against real processes: llama-servers, Redis and the proxy as a subprocess."""

from __future__ import annotations

import asyncio
import functools
import json
import operator
import signal
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from proxy.app import SCHEDULER
from testbed.probes import metric, until_listed
from testbed.stack import LlamaServer, ProxyProcess, Served, looping_client
from tests.conftest import chat
from tests.relay import Relay
from tests.waiting import PLACED, Remote, scrape, until, until_down, until_metric, until_ready

ADMIN = {
    "LLAMA_CACHE_PROXY_ADMIN_TOKEN": "t",
    "LLAMA_CACHE_PROXY_HEALTH__INTERVAL_SECONDS": "0.2",
    # two llama-servers with 2 threads each on 2 cores slow to seconds per token while one
    # reloads its model: queued requests may wait long, which is not what is tested here
    "LLAMA_CACHE_PROXY_QUEUE__MAX_WAIT_SECONDS": "300",
}
AUTH = {"Authorization": "Bearer t"}


@pytest.fixture
def proxies() -> Iterator[list[ProxyProcess]]:
    started: list[ProxyProcess] = []
    yield started
    for proxy in started:
        proxy.stop()


def long_count() -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Count from 1 to 400, separated by commas."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }


async def table(session: aiohttp.ClientSession, proxy: ProxyProcess) -> dict[str, Any]:
    async with session.get(proxy.url + "/admin/slots", headers=AUTH) as resp:
        found: dict[str, Any] = await resp.json()
        return found


async def test_backend_killed_mid_stream_then_back(
    llama_servers: Any, proxies: list[ProxyProcess]
) -> None:
    servers: list[LlamaServer] = [llama_servers(slots=1), llama_servers(slots=1)]
    proxy = ProxyProcess([s.url for s in servers], env=ADMIN).start()
    proxies.append(proxy)
    by_label = {f"127.0.0.1:{s.port}": s for s in servers}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        started = time.monotonic()
        async with session.post(proxy.url + "/v1/chat/completions", json=long_count()) as resp:
            victim = by_label[resp.headers["X-Cache-Backend"]]
            lines = []
            async for line in resp.content:
                lines.append(line)
                if len(lines) == 10:
                    victim.stop()  # SIGKILL mid-stream
        assert time.monotonic() - started < 30  # never a hang
        events = [json.loads(x[6:]) for x in lines if x.startswith(b"data: {")]
        assert "error" in events[-1]  # the stream ends with one SSE error event
        survivor = next(s for s in servers if s is not victim)
        for _ in range(3):  # requests not yet sent go to the other backend
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            async with session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["X-Cache-Backend"] == f"127.0.0.1:{survivor.port}"
        phases = {b["label"]: b["phase"] for b in (await table(session, proxy))["backends"]}
        assert phases[f"127.0.0.1:{victim.port}"] == "down"
        victim.start()  # it comes back: probed, slot state empty, traffic returns
        for _ in range(100):
            backends = (await table(session, proxy))["backends"]
            back = next(b for b in backends if b["label"] == f"127.0.0.1:{victim.port}")
            if back["phase"] == "ready":
                break
            await asyncio.sleep(0.1)
        assert back["phase"] == "ready"
        assert all(s["estimated_tokens"] == 0 for s in back["slots"])
        bodies = [
            {"messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 4}
            for i in range(4)
        ]
        answers = await asyncio.gather(
            *(session.post(proxy.url + "/v1/chat/completions", json=b) for b in bodies)
        )
        texts = [await a.text() for a in answers]
        assert [a.status for a in answers] == [200] * 4, texts
        assert {a.headers["X-Cache-Backend"] for a in answers} == set(by_label)


async def test_proxy_restart_keeps_sessions_on_their_slots(
    llama_servers: Any, redis_server: Any, proxies: list[ProxyProcess]
) -> None:
    servers = [llama_servers(slots=2), llama_servers(slots=2)]
    proxy = ProxyProcess([s.url for s in servers], redis_url=redis_server.url).start()
    proxies.append(proxy)
    system = "You are a patient tutor. " * 40
    histories = {
        s: [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Session {s}: explain topic {s} in depth."},
        ]
        for s in range(3)
    }
    placed: dict[int, tuple[str, str]] = {}
    prompts: dict[int, int] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def turn(s: int) -> tuple[dict[str, Any], tuple[str, str]]:
            body = {"messages": histories[s], "max_tokens": 8, "temperature": 0}
            async with session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                data = await resp.json()
                where = (resp.headers["X-Cache-Backend"], resp.headers["X-Cache-Slot"])
            histories[s] += [
                {"role": "assistant", "content": data["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Go on."},
            ]
            return data, where

        for s in range(3):
            data, placed[s] = await turn(s)
            prompts[s] = data["usage"]["prompt_tokens"]
        proxy.stop(kill=True)  # the proxy dies; Redis keeps slot records and affinities
        proxy.start()
        remote, labels = Remote(session, proxy.url), {f"127.0.0.1:{s.port}" for s in servers}

        async def both_ready() -> bool:
            resp = await remote.get("/readyz")
            return resp.status == 200 and set((await resp.json())["backends"]) == labels

        await until(both_ready, "the restarted proxy sees both backends ready", 60)
        for s in range(3):
            data, where = await turn(s)
            assert where == placed[s], (s, where, placed)  # warm restart: same slot
            assert data["timings"]["cache_n"] >= 0.9 * prompts[s]


async def test_redis_stopped_and_restarted_under_steady_traffic(
    llama_servers: Any, redis_server: Any, proxies: list[ProxyProcess]
) -> None:
    server = llama_servers(slots=2)
    pair = [ProxyProcess([server.url], redis_url=redis_server.url).start() for _ in range(2)]
    proxies.extend(pair)
    # each has read the other's heartbeat, and seen it read its own: a replica a peer may
    # not know yet pins nothing in an outage (tests/integration/test_outage.py)
    await until_listed([p.url for p in pair])
    served: list[Served] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        urls = [p.url for p in pair]
        workers = [
            asyncio.create_task(looping_client(session, urls, w, stop, served)) for w in range(4)
        ]
        await until(lambda: len(served) >= 4, "traffic before the outage", 60)
        redis_server.stop()
        outage = time.monotonic()
        # a replica claims its part once its peers must have read its heartbeat lapse (up to
        # 1.75 s after its last one), then polls /slots: wait until each has served a request
        # sent during the outage (how soon: bench.outage), or the deadline passes
        deadline = outage + 30.0
        during: set[int] = set()
        while during != {0, 1} and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            during = {s.replica for s in served if s.sent > outage}
        down = [await metric_of(session, p, "llama_cache_proxy_state_store_up") for p in pair]
        redis_server.start()
        for _ in range(50):
            up = [await metric_of(session, p, "llama_cache_proxy_state_store_up") for p in pair]
            if up == [1.0, 1.0]:
                break
            await asyncio.sleep(0.1)
        back = len(served)
        await until(lambda: len(served) >= back + 4, "traffic once Redis is back", 60)
        stop.set()
        await asyncio.gather(*workers)
    assert down == [0.0, 0.0]  # both replicas noticed and routed on local state
    # and each served requests while Redis was down: a replica whose part of the slots was
    # leased by the other when Redis died used to queue everything until it came back
    assert during == {0, 1}
    assert up == [1.0, 1.0]  # and came back
    assert back >= 4
    assert len(served) > back
    assert {s.status for s in served} == {200}  # zero failed client requests


async def test_slots_pinned_during_a_redis_outage_are_respected_when_it_returns(
    llama_servers: Any, redis_server: Any, proxies: list[ProxyProcess]
) -> None:
    """Each replica runs a request on its own part of the split while Redis is down; Redis
    comes back while B's still generates. A's next request must not be pinned to B's slot
    while B's request runs there (on llama-server that can overwrite B's KV; the server
    defers it until B's request ends): it runs at once on A's own, free slot. A probes
    rarely, so what it knows of B's requests comes from Redis."""
    server = llama_servers(slots=2)
    rare = {"LLAMA_CACHE_PROXY_HEALTH__INTERVAL_SECONDS": "60"}
    a = ProxyProcess([server.url], redis_url=redis_server.url, env=rare).start()
    b = ProxyProcess([server.url], redis_url=redis_server.url).start()
    proxies.extend([a, b])
    await until_listed([a.url, b.url])  # heartbeats: each replica has read the other
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        post, short = functools.partial(post_slot, session), SHORT
        redis_server.stop()
        await post(a, short)
        await post(b, short)  # both have noticed the outage
        remotes = [Remote(session, p.url) for p in (a, b)]
        placed = [await scrape(r, PLACED) for r in remotes]
        first = asyncio.create_task(post(a, {**long_count(), "max_tokens": 40}))
        second = asyncio.create_task(post(b, {**long_count(), "max_tokens": 300}))
        for remote, before in zip(remotes, placed, strict=True):  # both given their slots
            await until_metric(remote, PLACED, functools.partial(operator.lt, before))
        redis_server.start()
        for _ in range(50):
            up = [await metric_of(session, p, "llama_cache_proxy_state_store_up") for p in (a, b)]
            if up == [1.0, 1.0]:
                break
            await asyncio.sleep(0.1)
        assert up == [1.0, 1.0]
        mine, _ = await first
        slot, sent = await post(a, short)
        theirs, ended = await second
    assert mine != theirs  # the outage's split
    assert (slot, sent < ended) == (mine, True)


SHORT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


async def post_slot(
    session: aiohttp.ClientSession, proxy: ProxyProcess, body: dict[str, Any]
) -> tuple[str, float]:
    """Post a chat completion; the slot it ran on and when it ended."""
    async with session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        await resp.read()
        return resp.headers["X-Cache-Slot"], time.monotonic()


async def metric_of(session: aiohttp.ClientSession, proxy: ProxyProcess, name: str) -> float:
    async with session.get(proxy.url + "/metrics") as resp:
        return metric(await resp.text(), name)


async def test_a_replica_cut_off_from_redis_alone_keeps_its_slot_to_itself(
    llama_servers: Any, redis_server: Any, proxies: list[ProxyProcess]
) -> None:
    """A partial outage: A's connection to Redis is cut (a relay), B keeps its own. A runs a
    long request on its part of the split, with no lease; B's two requests must not be
    pinned to A's slot while it runs there (llama-server would load the RAM cache into the
    busy slot and then defer the request until A's ends): both run on B's own slot and end
    first. Both probe ``/slots`` rarely, so only the fence keeps B off A's slot."""
    server = llama_servers(slots=2)
    rare = {"LLAMA_CACHE_PROXY_HEALTH__INTERVAL_SECONDS": "60"}
    relay = Relay(redis_server.url)
    a = ProxyProcess([server.url], redis_url=await relay.start(), env=rare)
    b = ProxyProcess([server.url], redis_url=redis_server.url, env=rare)
    proxies.extend([a, b])
    try:
        for proxy in (a, b):  # off the event loop, which runs the relay
            await asyncio.to_thread(proxy.start)
        await until_listed([a.url, b.url])  # heartbeats: each replica has read the other
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            post, short = functools.partial(post_slot, session), SHORT
            relay.cut()
            await post(a, short)  # served on A's part once B must have fenced it
            assert await metric_of(session, a, "llama_cache_proxy_state_store_up") == 0
            mine_a = Remote(session, a.url)
            before = await scrape(mine_a, PLACED)
            first = asyncio.create_task(post(a, {**long_count(), "max_tokens": 300}))
            await until_metric(mine_a, PLACED, lambda n: n > before)  # A's slot is taken
            theirs = await asyncio.gather(*(post(b, short) for _ in range(2)))
            mine, ended = await first
        assert all(slot != mine and done < ended for slot, done in theirs), (mine, theirs)
    finally:
        await relay.close()


async def test_a_frozen_backend_comes_back_with_its_slot_state(
    llama_servers: Any, proxy: Any
) -> None:
    """A llama-server stopped (SIGSTOP: a hung host, a cut network) long enough for its
    probes to time out is marked down; resumed, it is the same process with the same KV, and
    the conversation's next turn is predicted and served from its slot."""
    server = llama_servers(slots=2)
    client = await proxy(
        [server], health={"interval_seconds": 0.1}, timeouts={"probe_seconds": 0.5}
    )
    first = chat("Tell me about the history of the harbour town. " * 12, max_tokens=8)
    first["temperature"] = 0
    resp = await client.post("/v1/chat/completions", json=first)
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    backend = client.server.app[SCHEDULER].fleet.backends[0]
    await until(lambda: backend.max_task_id >= 0, "a probe reads the task ids")
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)
    try:
        await until_down(client, server)
    finally:
        server.proc.send_signal(signal.SIGCONT)
    await until_ready(client, 30)
    turn = {
        **first,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And then?"},
        ],
    }
    resp = await client.post("/v1/chat/completions", json=turn)
    assert resp.status == 200, await resp.text()
    assert int(resp.headers["X-Cache-Predicted-Tokens"]) > 0
    cached = (await resp.json())["timings"]["cache_n"]
    assert cached >= 0.9 * answer["usage"]["prompt_tokens"]
    assert await scrape(client, "llama_cache_proxy_backend_restarts_total") == 0


async def test_a_request_to_a_fleet_whose_server_is_gone_gets_a_503_soon(
    llama_servers: Any, proxies: list[ProxyProcess]
) -> None:
    """The one llama-server is killed and not restarted: a request waits a few probe rounds
    for it to listen again (a restarting server answers 503 while it loads), then gets a
    503, not one after the queue's bound (600 s); a request after that gets one at once.
    Directly, the client would have had its connection refused."""
    server: LlamaServer = llama_servers(slots=1)
    proxy = ProxyProcess([server.url], env=ADMIN).start()
    proxies.append(proxy)
    body = chat("Say hi.", max_tokens=2, temperature=0)
    async with aiohttp.ClientSession() as session:
        await until_ready(Remote(session, proxy.url))
        async with session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
        server.stop()
        for bound in (60.0, 1.0):
            started = time.monotonic()
            async with session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
                answer = await resp.json()
            assert (resp.status, answer["error"]["code"]) == (503, "no_backend")
            assert time.monotonic() - started < bound

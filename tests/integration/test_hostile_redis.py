"""Whoever can write to Redis cannot redirect the replicas' traffic, and a client cannot pass
for a replica (``core.replicas.auth``, ``proxy.http.forwarding``): two replicas on one real Redis in
front of fake llama-servers, and an attacker's listener (a fake llama-server too)."""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from typing import Any

import pytest
from redis import asyncio as aioredis

from proxy.core.prompt.headers import FORWARDED_BY
from proxy.core.replicas.auth import request_parts, sign_entry, sign_forward
from proxy.state import keys
from testbed.probes import metric, until_listed
from tests.conftest import REPLICA_SECRET
from tests.integration.test_routing_fake import SYSTEM
from tests.waiting import until_metric

FORWARDS = "llama_cache_proxy_forwarded_requests_total"
REQUESTS = "llama_cache_proxy_requests_total"
REJECTED = "llama_cache_proxy_replica_entries_rejected"
LIVE = "llama_cache_proxy_replicas_live"
CHAT = "/v1/chat/completions"


def _turn(session: int, history: list[dict[str, Any]]) -> dict[str, Any]:
    if not history:
        history.append({"role": "system", "content": SYSTEM})
    history.append({"role": "user", "content": f"session {session}: " + "go on " * 20})
    return {"messages": list(history), "max_tokens": 6}


async def _pair(fakes: Any, proxy: Any, redis_url: str, **over: Any) -> tuple[list[Any], Any]:
    backends = [await fakes(n_slots=2) for _ in range(2)]
    pair = [await proxy(backends, redis_url=redis_url, **over) for _ in "ab"]
    return backends, pair


async def _sessions(pair: list[Any], turns: int = 2) -> int:
    """Four sessions, each turn through the other replica; every answer a 200 with text."""
    histories: dict[int, list[dict[str, Any]]] = defaultdict(list)
    sent = 0
    for turn in range(turns):
        for session in range(4):
            body = _turn(session, histories[session])
            resp = await pair[(session + turn) % 2].post(CHAT, json=body)
            assert resp.status == 200, await resp.text()
            reply = (await resp.json())["choices"][0]["message"]["content"]
            assert reply
            histories[session].append({"role": "assistant", "content": reply})
            sent += 1
    return sent


async def _metrics(client: Any) -> str:
    return str(await (await client.get("/metrics")).text())


async def test_poisoned_replica_entries_never_redirect_traffic(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """Entries a Redis writer adds to the replicas' list, each with a far-future score:
    unsigned, signed with another secret, a genuine entry replayed with a later score,
    undecodable bytes (one shaped as a signed entry: its signature was compared as text,
    whose TypeError ended the replicas' background task), and one signed with the secret
    for an address off the allowlist (a host name); plus garbage slot records and leases. No
    request reaches the attacker, every one is answered, and the replicas list only each
    other. Before, one unsigned ``ZADD`` made the replicas forward part of their requests,
    headers included, to its URL."""
    attacker = await fakes(n_slots=4)
    port = attacker.url.rsplit(":", 1)[1]
    backends, pair = await _pair(fakes, proxy, redis_server.url)
    await until_listed([str(c.make_url("")).rstrip("/") for c in pair])
    redis = aioredis.Redis.from_url(redis_server.url)
    far = time.time() + 10**6
    first: Any = (await redis.zrange(keys.REPLICAS, 0, 0))[0]
    genuine = first.decode()
    secret = REPLICA_SECRET.encode()
    poison: dict[Any, float] = {
        f"x@http://127.0.0.1:{port}": far,
        f"y@http://127.0.0.1:{port}|{far:.3f}|" + "0" * 64: far,
        sign_entry(b"another secret", f"z@http://127.0.0.1:{port}", far): far,
        genuine: far,  # a real replica's entry kept alive for good
        b"\xff\xfe@http://127.0.0.1:" + port.encode(): far,
        b"x|99999999999|\xff": far,
    }
    try:
        await redis.zadd(keys.REPLICAS, poison)
        for fake in backends:
            label = fake.url.removeprefix("http://")
            for slot in range(2):
                await redis.set(keys.slot(label, slot), b"\x00garbage\xff" * 3)
        await redis.set(keys.lease(backends[0].url.removeprefix("http://"), 0), b"\xff\xfe")
        signed = sign_entry(secret, f"w@http://localhost:{port}", far)  # off the allowlist
        await redis.zadd(keys.REPLICAS, {signed: far - 1})
        for c in pair:  # until both replicas have read the list since (w is live)
            await until_metric(c, LIVE, lambda n: n >= 3)
        await _sessions(pair)
        texts = [await _metrics(c) for c in pair]
    finally:
        await redis.aclose()
    assert [path for path, _, _ in attacker.received if path == CHAT] == []
    for text in texts:
        assert metric(text, REJECTED) >= len(poison) - 1  # (the replayed one is replaced)
        assert metric(text, LIVE) == 3  # a, b and w
    served = sum(1 for fake in backends for path, _, _ in fake.received if path == CHAT)
    assert served == 8


async def test_a_client_cannot_pass_for_a_replica(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """A client's ``X-Cache-Forwarded-By`` (made up, signed with another secret, or a
    replica's mark replayed for another body or after its window, or one whose signature is
    not ASCII, once a 500) is not believed: the request is forwarded to its backend's home
    like any other, counted ``rejected``, never ``received``, and the header reaches no
    backend. Before, any value was believed: the request skipped forwarding and counted as
    received from a replica."""
    backends, pair = await _pair(fakes, proxy, redis_server.url)
    await until_listed([str(c.make_url("")).rstrip("/") for c in pair])
    secret, bodies = REPLICA_SECRET.encode(), []
    for session in range(4):  # the sessions start at replica a, on a's backends
        history: list[dict[str, Any]] = []
        resp = await pair[0].post(CHAT, json=_turn(session, history))
        assert resp.status == 200, await resp.text()
        history.append({"role": "assistant", "content": "ok"})
        bodies.append(json.dumps(_turn(session, history)).encode())
    for n, body in enumerate(bodies):  # their next turns reach b, with a client's marks
        now, ids = time.time(), [f"r{n}-{i}" for i in range(5)]
        marks = [
            "another replica",
            sign_forward(b"another secret", "x", now, _parts(ids[1], body)),
            sign_forward(secret, "x", now, _parts(ids[2], bodies[(n + 1) % 4])),
            sign_forward(secret, "x", now - 60, _parts(ids[3], body)),
            "a;1;\u00e9",
        ]
        for request_id, mark in zip(ids, marks, strict=True):
            headers = {FORWARDED_BY: mark, "X-Request-Id": request_id}
            headers["Content-Type"] = "application/json"
            resp = await pair[1].post(CHAT, data=body, headers=headers)
            assert resp.status == 200, await resp.text()
    a, b = [await _metrics(c) for c in pair]
    assert metric(b, FORWARDS, outcome="rejected") == 20
    assert metric(b, FORWARDS, outcome="sent") > 0  # the marks did not stop forwarding
    assert metric(a, FORWARDS, outcome="received") == metric(b, FORWARDS, outcome="sent")
    assert metric(a, FORWARDS, outcome="rejected") == 0
    seen = [h for fake in backends for path, _, h in fake.received if path == CHAT]
    assert len(seen) == 24
    assert all(FORWARDED_BY.lower() not in {k.lower() for k in h} for h in seen)


def _parts(request_id: str, body: bytes) -> tuple[str, ...]:
    return request_parts(request_id, "POST", CHAT, body)


async def test_a_forwarded_request_is_counted_once_in_requests_total(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """Summed over the replicas, ``requests_total`` counts every client request once: the
    replica that served it counts it; the one that relayed it, only in
    ``forwarded_requests_total{outcome="sent"}``. Before, both counted it. So does
    ``request_duration_seconds``."""
    _, pair = await _pair(fakes, proxy, redis_server.url)
    await until_listed([str(c.make_url("")).rstrip("/") for c in pair])
    sent = await _sessions(pair)
    texts = [await _metrics(c) for c in pair]
    assert sum(metric(t, FORWARDS, outcome="sent") for t in texts) > 0
    assert sum(metric(t, REQUESTS, endpoint=CHAT) for t in texts) == sent
    durations = "llama_cache_proxy_request_duration_seconds_count"
    assert sum(metric(t, durations, endpoint=CHAT) for t in texts) == sent


async def test_without_a_secret_replicas_do_not_forward(
    fakes: Any, proxy: Any, redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """No ``replicas.secret``: no replica advertises a URL, so none forwards (each routes
    what reaches it), and each says so at start-up."""
    caplog.set_level(logging.WARNING, logger="proxy.http.forwarding")
    _, pair = await _pair(fakes, proxy, redis_server.url, replicas={})
    await until_listed([str(c.make_url("")).rstrip("/") for c in pair])
    await _sessions(pair)
    for text in [await _metrics(c) for c in pair]:
        assert metric(text, FORWARDS, outcome="sent") == 0
    assert "replicas.secret is not set" in caplog.text


async def test_bytes_another_writer_left_are_ignored_as_absent(
    fakes: Any, proxy: Any, redis_server: Any, tmp_path: Any
) -> None:
    """Values in the proxy's keys that it never wrote (an affinity with no slot number, or
    not UTF-8; a window entry that is no record; a release id that is no number; a snapshot
    index field that is not UTF-8) are read as absent. Before, each was a 500 for every
    request that read it (every turn of the session; every long chat, for an hour) and the
    last one ended start-up with an error, for every replica that restarted."""
    redis = aioredis.Redis.from_url(redis_server.url)
    await redis.hset(keys.SNAPSHOTS, b"\xff", b"[]")
    backend = await fakes(n_slots=2, save_dir=tmp_path)
    over = {"disk": {"slot_save_dir": str(tmp_path), "min_tokens": 64}, "admin_token": "t"}
    client = await proxy([backend], redis_url=redis_server.url, **over)  # (start-up reads it)
    await redis.set(keys.affinity("s1"), b"x|notanumber")
    await redis.set(keys.affinity("s2"), b"\xff\xfe|0")
    await redis.lpush(keys.window("default"), b"garbage")
    long = "the quarterly report covers revenue and costs " * 60
    for key in ("s1", "s2"):
        body = {"messages": [{"role": "user", "content": long}], "max_tokens": 2}
        resp = await client.post(CHAT, json={**body, "prompt_cache_key": key})
        assert resp.status == 200, await resp.text()
    releases = [k async for k in redis.scan_iter(match=keys.PREFIX + "ret:*")]
    assert releases
    value = await redis.get(releases[0])
    assert isinstance(value, bytes)
    owner = value.decode().rpartition(":")[0]
    for name in releases:
        await redis.set(name, f"{owner}:notanumber|1", px=60_000)
    body = {"messages": [{"role": "user", "content": long}], "max_tokens": 2}
    resp = await client.post(CHAT, json={**body, "prompt_cache_key": "s1"})
    assert resp.status == 200, await resp.text()
    resp = await client.get("/admin/disk", headers={"Authorization": "Bearer t"})
    assert resp.status == 200, await resp.text()
    await redis.aclose()

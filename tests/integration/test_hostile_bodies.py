"""Hostile bodies: an encoded body or one over the limit is answered unread and its
connection closed; a large body is parsed, fingerprinted and encoded off the event loop,
and only a few large bodies at once."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
from typing import Any

from proxy.app import HANDLERS
from proxy.http import handlers as handlers_module
from proxy.http import intake
from proxy.offload import LARGE_BODIES
from tests.conftest import chat

LIMIT = 1024 * 1024


async def _answer_then_eof(client: Any, head: bytes, body: bytes) -> bytes:
    """Send ``head`` and ``body`` (a part of what ``head`` announces) on a raw connection;
    the whole answer, once the proxy closes it (a bounded wait: aiohttp would otherwise
    read the rest of the body for up to 10 s)."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    try:
        writer.write(head + body)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout=5)
    finally:
        writer.close()


def _head(length: int, *extra: str) -> bytes:
    lines = ["POST /v1/chat/completions HTTP/1.1", "Host: proxy", f"Content-Length: {length}"]
    lines += ["Content-Type: application/json", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_a_gzip_bomb_is_refused_unread_and_the_connection_closes(
    fakes: Any, proxy: Any
) -> None:
    fake = await fakes()
    client = await proxy([fake], max_body_bytes=LIMIT)
    bomb = gzip.compress(b'{"messages": "' + b"0" * (256 * LIMIT), compresslevel=1)
    half = bomb[: len(bomb) // 2]  # inflates to far past the limit; the rest is never sent
    answer = await _answer_then_eof(client, _head(len(bomb), "Content-Encoding: gzip"), half)
    assert answer.startswith(b"HTTP/1.1 415")
    assert b"Connection: close" in answer
    assert b'"code": "unsupported_encoding"' in answer
    assert fake.received == []
    resp = await client.post("/v1/chat/completions", json=chat("hello", max_tokens=2))
    assert resp.status == 200  # the proxy serves on


async def test_a_body_over_the_limit_is_refused_unread_and_the_connection_closes(
    fakes: Any, proxy: Any
) -> None:
    fake = await fakes()
    client = await proxy([fake], max_body_bytes=LIMIT)
    answer = await _answer_then_eof(client, _head(4 * LIMIT), b"{" + b" " * 1000)
    assert answer.startswith(b"HTTP/1.1 413")
    assert b"Connection: close" in answer
    assert fake.received == []


async def test_an_identity_encoding_is_served(fakes: Any, proxy: Any) -> None:
    fake = await fakes()
    client = await proxy([fake])
    headers = {"Content-Encoding": "identity", "Content-Type": "application/json"}
    raw = json.dumps(chat("hello", max_tokens=2))
    assert (await client.post("/v1/chat/completions", data=raw, headers=headers)).status == 200


async def test_a_large_prompt_is_fingerprinted_in_a_worker_thread(fakes: Any, proxy: Any) -> None:
    """A prompt of many messages is fingerprinted off the loop (so /healthz answers while
    it is), a small one on it."""
    fake = await fakes()
    client = await proxy([fake])
    offload = client.app[HANDLERS]._offload
    small = await client.post("/v1/chat/completions", json=chat("hello", max_tokens=2))
    assert small.status == 200
    assert offload.threads == set()
    messages = [{"role": "user", "content": f"message {i}"} for i in range(20_000)]
    big = asyncio.create_task(
        client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    )
    health = await client.get("/healthz")
    assert health.status == 200
    await (await big).read()  # (the fake's context is too small for it: its 400)
    assert len(fake.received) == 2  # routed, then forwarded
    assert offload.threads
    assert threading.get_ident() not in offload.threads


def _many_messages(count: int) -> bytes:
    messages = [{"role": "user", "content": f"message {i}"} for i in range(count)]
    return json.dumps({"messages": messages, "max_tokens": 2}).encode()


def _threads_of(monkeypatch: Any, owner: Any, name: str) -> list[int]:
    """The threads ``owner.name`` runs in, from now on, one entry per call."""
    real, threads = getattr(owner, name), []

    def spy(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return threads


def _off_the_loop(threads: list[int]) -> bool:
    return bool(threads) and threading.get_ident() not in threads


async def test_a_large_chunked_prompt_is_fingerprinted_in_a_worker_thread(
    fakes: Any, proxy: Any, monkeypatch: Any
) -> None:
    """Without a Content-Length the body's own length decides, not a size of 0."""
    fake = await fakes()
    client = await proxy([fake])
    threads = _threads_of(monkeypatch, client.app[HANDLERS]._router, "fingerprint")
    raw = _many_messages(20_000)

    async def chunks() -> Any:
        for start in range(0, len(raw), 64 * 1024):
            yield raw[start : start + 64 * 1024]

    headers = {"Content-Type": "application/json"}
    resp = await client.post("/v1/chat/completions", data=chunks(), headers=headers)
    await resp.read()
    assert resp.request_info.headers.get("Transfer-Encoding") == "chunked"
    assert len(fake.received) == 1
    assert _off_the_loop(threads)


async def test_a_large_body_is_parsed_and_encoded_in_a_worker_thread(
    fakes: Any, proxy: Any, monkeypatch: Any
) -> None:
    fake = await fakes()
    client = await proxy([fake])
    parsed = _threads_of(monkeypatch, intake, "parse_body")
    encoded = _threads_of(monkeypatch, handlers_module, "pin_body")
    headers = {"Content-Type": "application/json"}
    resp = await client.post("/v1/chat/completions", data=_many_messages(20_000), headers=headers)
    await resp.read()
    assert len(fake.received) == 1
    assert _off_the_loop(parsed)
    assert _off_the_loop(encoded)


async def test_only_a_few_large_bodies_are_parsed_and_routed_at_once(
    fakes: Any, proxy: Any, monkeypatch: Any
) -> None:
    fake = await fakes(n_slots=4)
    client = await proxy([fake])
    router = client.app[HANDLERS]._router
    plan, inside, most = router.plan, [0], [0]

    async def slow_plan(*args: Any) -> Any:
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        try:
            await asyncio.sleep(0.2)  # a plan that takes a while: the overlap is what is tested
            return await plan(*args)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(router, "plan", slow_plan)
    raw, headers = _many_messages(20_000), {"Content-Type": "application/json"}
    posts = [client.post("/v1/chat/completions", data=raw, headers=headers) for _ in range(5)]
    statuses = [resp.status for resp in await asyncio.gather(*posts)]
    assert statuses == [400] * 5  # all answered by the backend, in turn (past its context)
    assert 1 <= most[0] <= LARGE_BODIES

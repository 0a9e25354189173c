"""The proxy in front of real llama-servers (SmolLM2-135M on the CPU)."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import subprocess
import sys
from typing import Any

import aiohttp

from testbed.probes import metric, server_timing
from testbed.stack import LlamaServer, free_port, wait_http
from tests.conftest import chat
from tests.waiting import until_ready

GREEDY = {"temperature": 0, "seed": 42, "max_tokens": 24}


async def _direct(server: LlamaServer, path: str, body: dict[str, Any]) -> Any:
    """A cold, uncached request straight to llama-server: the reference output."""
    async with aiohttp.ClientSession() as session:
        sent = {**body, "cache_prompt": False}
        async with session.post(server.url + path, json=sent) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.text() if body.get("stream") else await resp.json()


def _stream_text(raw: str) -> str:
    out = []
    for event in raw.split("\n\n"):
        payload = event.removeprefix("data: ").strip()
        if not payload or payload == "[DONE]":
            continue
        for choice in json.loads(payload).get("choices", []):
            out.append((choice.get("delta") or {}).get("content") or "")
    return "".join(out)


async def test_greedy_output_through_proxy_equals_direct(llama_servers: Any, proxy: Any) -> None:
    server = llama_servers(slots=2)
    client = await proxy([server.url])
    body = chat("Name three colours of the rainbow.", **GREEDY)
    via = await (await client.post("/v1/chat/completions", json=body)).json()
    direct = await _direct(server, "/v1/chat/completions", body)
    assert via["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]

    body = chat("Count from one to five in words.", stream=True, **GREEDY)
    raw = await (await client.post("/v1/chat/completions", json=body)).text()
    assert _stream_text(raw) == _stream_text(await _direct(server, "/v1/chat/completions", body))
    assert raw.rstrip().endswith("data: [DONE]")


async def test_repeated_prompt_reuses_its_slot_kv(llama_servers: Any, proxy: Any) -> None:
    server = llama_servers(slots=2)
    client = await proxy([server.url])
    a = chat("You are a terse assistant. " * 20 + "What is two plus two?", **GREEDY)
    b = chat("Describe the sea in one sentence.", **GREEDY)
    results = []
    for body in (a, b, a):  # LRU: the third request lands on the slot that holds A
        resp = await client.post("/v1/chat/completions", json=body)
        results.append((await resp.json())["timings"])
    prompt = results[2]["prompt_n"] + results[2]["cache_n"]
    assert prompt > 100
    assert results[2]["cache_n"] >= prompt - 2
    page = await (await client.get("/metrics")).text()
    assert "llama_cache_proxy_cached_tokens_total" in page


async def test_more_concurrent_requests_than_slots_all_correct(
    llama_servers: Any, proxy: Any
) -> None:
    server = llama_servers(slots=2)
    client = await proxy([server.url], queue={"max_wait_seconds": 60})
    bodies = [
        chat(f"Write the number {i} as a word.", stream=i % 2 == 1, **GREEDY) for i in range(6)
    ]
    responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
    assert [r.status for r in responses] == [200] * 6
    # four of them waited for a slot a request held to its end, and their headers say so
    queued = [server_timing(r.headers["Server-Timing"])["queue"] for r in responses]
    assert sum(ms >= 20 for ms in queued) >= 4
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_slot_wait_seconds_count") == 6
    for body, resp in zip(bodies, responses, strict=True):
        expected = await _direct(server, "/v1/chat/completions", body)
        if body.get("stream"):
            assert _stream_text(await resp.text()) == _stream_text(expected)
        else:
            got = (await resp.json())["choices"][0]["message"]["content"]
            assert got == expected["choices"][0]["message"]["content"]


async def test_client_abort_drains_slot_then_next_request_is_clean(
    llama_servers: Any, proxy: Any
) -> None:
    server = llama_servers(slots=1)
    client = await proxy([server.url])
    long_body = chat(
        "Count from 1 to 300, separated by commas.", stream=True, temperature=0, max_tokens=400
    )
    async with aiohttp.ClientSession() as session:
        resp = await session.post(str(client.make_url("/v1/chat/completions")), json=long_body)
        await resp.content.readany()
        resp.close()
    body = chat("Say hello.", **GREEDY)
    via = await (await client.post("/v1/chat/completions", json=body)).json()
    direct = await _direct(server, "/v1/chat/completions", body)
    assert via["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]


async def test_killed_backend_gives_503_then_recovers(llama_servers: Any, proxy: Any) -> None:
    server = llama_servers(slots=1)
    client = await proxy([server.url])
    body = chat("Hi.", temperature=0, max_tokens=4)
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    server.stop()
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 503
    assert (await resp.json())["error"]["type"] == "unavailable_error"
    server.start()
    await until_ready(client, 30)
    assert (await client.post("/v1/chat/completions", json=body)).status == 200


LONE_SURROGATE = rb'{"messages": [{"role": "user", "content": "a\ud800"}], "max_tokens": 2}'


async def test_bad_inputs_against_real_backend(llama_servers: Any, proxy: Any) -> None:
    server = llama_servers(slots=2)
    client = await proxy([server.url], max_body_bytes=65536)
    cases = [
        (b"{oops", 400),
        (json.dumps({"messages": "nope"}).encode(), 400),
        (json.dumps(chat("x" * 70000)).encode(), 413),
        (json.dumps(chat("hi", n=3)).encode(), 400),  # the server's own limit, passed through
        (LONE_SURROGATE, 400),  # as the server answers it (below); Python's decoder accepts it
    ]
    for raw, status in cases:
        resp = await client.post(
            "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}
        )
        assert resp.status == status, raw[:40]
        assert "error" in await resp.json()
    assert (await client.get("/nope")).status == 404
    assert (
        await client.post("/slots/0?action=save", json={"filename": "x"})
    ).status == 403  # a deliberate refusal
    async with aiohttp.ClientSession() as direct:
        async with direct.post(f"{server.url}/v1/chat/completions", data=LONE_SURROGATE) as resp:
            assert resp.status == 400
            assert "surrogate" in (await resp.json())["error"]["message"]
        gzipped = gzip.compress(json.dumps(chat("hi", max_tokens=2)).encode())
        encoded = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        async with direct.post(
            f"{server.url}/v1/chat/completions", data=gzipped, headers=encoded
        ) as resp:
            assert resp.status == 415  # the server takes no encoded body; the proxy neither
        resp = await client.post("/v1/chat/completions", data=gzipped, headers=encoded)
        assert resp.status == 415
        for wide, served in ((2**64, 400), (2**40, 200)):
            body = {"prompt": [1, wide], "n_predict": 1}
            async with direct.post(f"{server.url}/completion", json=body) as resp:
                # past 64 bits the server refuses; within, it wraps the id to 32 bits (token 0)
                assert resp.status == served
            # the proxy fingerprints 32-bit ids and says so rather than guess a wrapped token
            assert (await client.post("/completion", json=body)).status == 400
    paired = json.dumps(chat("\U0001f600 hi", max_tokens=2)).encode()  # ensure_ascii: a pair
    assert b"\\ud83d\\ude00" in paired
    resp = await client.post(
        "/v1/chat/completions", data=paired, headers={"Content-Type": "application/json"}
    )
    assert resp.status == 200


async def test_bodies_the_server_serves_the_proxy_serves(llama_servers: Any, proxy: Any) -> None:
    """Loose bodies llama-server takes (an empty chat, counts written as booleans, an
    ``id_slot`` or ``model`` of another type) and one it refuses: the same status, directly
    and through the proxy."""
    server = llama_servers(slots=2)
    client = await proxy([server.url])
    hi = [{"role": "user", "content": "Hi"}]
    cases = [
        ("/v1/chat/completions", {"messages": [], "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": hi, "max_tokens": 2, "id_slot": "x"}),
        ("/v1/chat/completions", {"messages": hi, "max_tokens": 2, "model": 5}),
        ("/v1/chat/completions", {"messages": hi, "max_tokens": 2, "n": True}),
        ("/completion", {"prompt": "Hi", "n_predict": True}),
        ("/v1/chat/completions", {"messages": hi, "max_tokens": "x"}),
    ]
    async with aiohttp.ClientSession() as direct:
        for path, body in cases:
            async with direct.post(server.url + path, json=body) as resp:
                expected = resp.status
            assert (await client.post(path, json=body)).status == expected, body
    assert expected == 400  # the last: a count that is not a number


def test_cli_serves_the_readme_command(llama_servers: Any) -> None:
    server = llama_servers(slots=1)
    port = free_port()
    env = {**os.environ, "LLAMA_CACHE_PROXY_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy",
            "serve",
            "--backend",
            server.url,
            "--listen",
            f"127.0.0.1:{port}",
        ],
        env=env,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", 30, proc)
        import urllib.request

        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(chat("Hi.", temperature=0, max_tokens=4)).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert json.loads(resp.read())["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        assert proc.wait(10) == 0

"""Greedy output through the proxy is byte-identical to llama-server's own, on every path.

Each request (temperature 0, a fixed seed) is first sent straight to llama-server with
``cache_prompt: false``: a cold prefill, the reference. The same requests then go through the
proxy, each taking one path (read from ``X-Cache-Route``): a miss, a prefix hit, an affinity
hit (``prompt_cache_key``), a session parked to disk when a stranger takes its slot and
restored on its return, and, after a backend restart, restores of a saved system prompt and
of a parked session. One slot and no RAM prompt cache, so the proxy's disk tier is the only
way back. On Gemma 3 (sliding window) with ``--swa-full``: without it the server reuses no
restored slot.

A reply that differs from the cold one must be what llama-server itself answers to the
proxy's traffic: every request the proxy sent (warm-ups and slot actions included) is
recorded and replayed straight to a fresh server, and the reply must match byte for byte
(on SmolLM2 every path equals the cold reply; on Gemma 3 the prefix and affinity hits do
not, and the replay reproduces them: see docs/disk-tier.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from testbed.stack import LlamaServer
from tests.real.test_real_disk import disk, settle

SYSTEM = "you are the release agent of a small team and you follow these rules " + " ".join(
    f"rule {i} keep change {i} small and tested" for i in range(40)
)
GREEDY = {"max_tokens": 16, "temperature": 0, "seed": 42}


def _session(name: str, turns: int, key: str | None = None) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"session {name} list three checks for the release"},
    ]
    for i in range(1, turns):
        messages += [
            {"role": "assistant", "content": f"noted {i}"},
            {"role": "user", "content": f"and what comes after step {i}"},
        ]
    return {"messages": messages, **GREEDY, **({"prompt_cache_key": key} if key else {})}


STRANGER = {"messages": [{"role": "user", "content": "say hi"}], **GREEDY}
# (what the step shows, the request, the route it must take)
STEPS: list[tuple[str, dict[str, Any], str]] = [
    ("miss", _session("alpha", 1), ""),
    ("prefix hit", _session("alpha", 2), "prefix"),
    ("a stranger takes the slot: alpha is parked", STRANGER, ""),
    ("unpark: alpha restored from disk", _session("alpha", 3), "disk"),
    ("a keyed session sharing the system prompt", _session("beta", 1, key="b"), ""),
    ("affinity hit", _session("beta", 2, key="b"), "affinity"),
    ("restart", {}, ""),
    ("after the restart: the system prompt restored", _session("gamma", 1), "disk"),
    ("after the restart: alpha restored from disk", _session("alpha", 4), "disk"),
]


async def _text(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return str((await resp.json())["choices"][0]["message"]["content"])


async def _direct(url: str, body: dict[str, Any]) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await _text(session, url, body)


class Recorder:
    """Between the proxy and llama-server: relays every request and records the POSTs that
    change a slot (completions, warm-ups, slot actions), to replay them directly."""

    def __init__(self, server: LlamaServer) -> None:
        self.server = server
        self.log: list[Any] = []  # (path with query, body) or None: a restart
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.relay)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def relay(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.method == "POST" and not request.path.endswith(STATELESS):
            self.log.append((request.path_qs, body))
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                request.method, self.server.url + request.path_qs, data=body, headers=headers
            ) as resp,
        ):
            data = await resp.read()
            kind = resp.headers.get("Content-Type", "application/json").split(";")[0]
            return web.Response(status=resp.status, body=data, content_type=kind)

    async def replay(self) -> list[bytes]:
        """Every recorded request's answer, sent straight to a fresh server in order."""
        self.server.stop()
        self.server.start()
        answers = []
        timeout = aiohttp.ClientTimeout(total=300)
        connector = aiohttp.TCPConnector(force_close=True)  # the server restarts between
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            for entry in self.log:
                if entry is None:
                    self.server.stop()
                    self.server.start()
                    answers.append(b"")
                    continue
                path, body = entry
                headers = {"Content-Type": "application/json"}
                url = self.server.url + path
                async with session.post(url, data=body, headers=headers) as resp:
                    answers.append(await resp.read())
        return answers


STATELESS = ("/tokenize", "/detokenize", "/apply-template")


async def _compare(server: LlamaServer, proxy: Any) -> list[str]:
    """Each step's differences from the reference (none when byte-identical). A reply that
    differs from a cold prefill must be the server's own reply to the proxy's requests,
    replayed straight to a fresh server (the direct control: the same KV history)."""
    cold = {}
    for name, body, _ in STEPS:
        if body:
            cold[name] = await _direct(server.url, {**body, "cache_prompt": False})
    # the replay starts on a fresh server, and so does the run it checks (else the run's slot
    # would start with the references' KV, the replay's empty)
    server.stop()
    server.start()
    recorder = Recorder(server)
    relay = await recorder.start()
    backends = [{"url": relay, "ram_cache": False}]
    client = await proxy(
        backends,
        disk=disk(server, park_min_tokens=200),
        health={"interval_seconds": 0.2},
    )
    recorder.log.clear()  # the proxy's start-up probes of a server holding the references
    await _direct(relay, STRANGER)  # the slot holds nothing of the sessions: a real miss
    problems, controls = [], []
    for name, body, route in STEPS:
        if not body:
            recorder.log.append(None)
            await settle(client, server)
            continue
        start = len(recorder.log)
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200, await resp.text()
        taken = resp.headers["X-Cache-Route"]
        answer = await resp.json()
        text = answer["choices"][0]["message"]["content"]
        if route not in taken:
            problems.append(f"{name}: route {taken}, not {route}")
        if text.encode() != cold[name].encode():
            sent = [entry[0] for entry in recorder.log[start:] if entry is not None]
            reused = f"reused {answer['timings']['cache_n']} after {sent}"
            controls.append((name, taken, text, reused, len(recorder.log) - 1))
    await recorder.runner.cleanup()  # type: ignore[union-attr]
    answers = await recorder.replay() if controls else []
    for name, taken, text, reused, index in controls:
        replayed = json.loads(answers[index])
        again = replayed["choices"][0]["message"]["content"]
        if text.encode() != again.encode():
            problems.append(
                f"{name} ({taken}, {reused}): {text!r}; cold {cold[name]!r}; "
                f"replayed {again!r} (reused {replayed['timings']['cache_n']})"
            )
    return problems


async def test_greedy_output_is_byte_identical_on_every_path_smollm2(
    llama_servers: Callable[..., LlamaServer], proxy: Any
) -> None:
    server = llama_servers(slots=1, extra=("--cache-ram", "0"))
    assert await _compare(server, proxy) == []


async def test_greedy_output_is_byte_identical_on_every_path_gemma3(
    gemma_servers: Callable[..., LlamaServer], proxy: Any
) -> None:
    server = gemma_servers(swa_full=True, slots=1, ctx_per_slot=4096, extra=("--cache-ram", "0"))
    assert await _compare(server, proxy) == []

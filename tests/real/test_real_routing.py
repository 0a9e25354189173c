"""Prefix-aware routing against real llama-servers (SmolLM2-135M, CPU)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import urllib.request
from typing import Any

import aiohttp
import pytest

from testbed.probes import metric, until_listed
from testbed.stack import REPLICA_SECRET, free_port, wait_http
from tests.conftest import delta_text, events_to_done

SYSTEM = (
    "You are a careful assistant for a small software team. Answer briefly, use plain "
    "words, and never invent facts. "
) * 4
TOPICS = ["gardening", "sailing", "baking", "chess", "astronomy", "cycling"]


def opening(session: int) -> str:
    topic = TOPICS[session]
    return (
        f"Session {session}. We will talk about {topic}. "
        + f"Some notes on {topic}: "
        + " ".join(f"{topic} fact number {i} is worth remembering." for i in range(12))
    )


async def run_sessions(clients: list[Any], sessions: int, turns: int) -> list[tuple[int, int, int]]:
    """Interleaved multi-turn sessions; returns (session, cache_n, previous prompt) per turn."""
    histories: dict[int, list[dict[str, Any]]] = {
        s: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(s)}]
        for s in range(sessions)
    }
    previous: dict[int, int] = {}
    out = []
    rng = random.Random(3)
    for turn in range(turns):
        order = rng.sample(range(sessions), sessions)
        for s in order:
            client = clients[(turn + s) % len(clients)]
            body = {
                "messages": histories[s],
                "max_tokens": 12,
                "temperature": 0,
                "prompt_cache_key": f"session-{s}",
            }
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status == 200, await resp.text()
            data = await resp.json()
            timings = data["timings"]
            if s in previous:
                out.append((s, timings["cache_n"], previous[s]))
            previous[s] = timings["prompt_n"] + timings["cache_n"]
            histories[s] += [
                {"role": "assistant", "content": data["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"Turn {turn}: tell me more."},
            ]
    return out


async def test_six_interleaved_sessions_on_two_by_two_slots(llama_servers: Any, proxy: Any) -> None:
    servers = [llama_servers(slots=2) for _ in range(2)]
    client = await proxy(
        [s.url for s in servers], queue={"max_wait_seconds": 120}, timeouts={"read_seconds": 120}
    )
    results = await run_sessions([client], sessions=6, turns=3)
    assert len(results) == 12
    for session, cache_n, previous in results:
        assert cache_n >= 0.9 * previous, (session, cache_n, previous)
    page = await (await client.get("/metrics")).text()
    accurate = metric(page, "llama_cache_proxy_route_predictions_total", outcome="accurate")
    assert accurate >= 0.9 * metric(page, "llama_cache_proxy_route_predictions_total")


async def test_cache_key_reuse_unsafe_and_busy_cases(
    llama_servers: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = llama_servers(slots=2)
    client = await proxy([server.url])
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(0)}]
    body = {"messages": history, "max_tokens": 8, "temperature": 0, "prompt_cache_key": "k"}
    first = await client.post("/v1/chat/completions", json=body)
    reply = (await first.json())["choices"][0]["message"]["content"]
    history = [
        *history,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "More, please."},
    ]
    again = await client.post("/v1/chat/completions", json={**body, "messages": history})
    assert again.headers["X-Cache-Route"] == "affinity"
    assert again.headers["X-Cache-Slot"] == first.headers["X-Cache-Slot"]
    timings = (await again.json())["timings"]
    assert timings["cache_n"] > 0.9 * (timings["prompt_n"] + timings["cache_n"]) - 16
    # an unrelated prompt under the same key: tiny overlap, no keyed reuse
    unrelated = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "prompt_cache_key": "k",
    }
    other = await client.post("/v1/chat/completions", json=unrelated)
    assert other.headers["X-Cache-Route"] != "affinity"
    # a long streamed request under the same key: the mapping follows it to its slot, which
    # stays busy while the reply streams (the proxy has claimed it before the headers came)
    long = {
        "messages": [{"role": "user", "content": "Count from 1 to 200."}],
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "prompt_cache_key": "k",
    }
    caplog.set_level(logging.INFO, logger="proxy.routing.router")
    streaming = await client.post("/v1/chat/completions", json=long)
    busy_slot = streaming.headers["X-Cache-Slot"]
    third = await client.post("/v1/chat/completions", json=unrelated)
    await streaming.read()
    assert third.status == 200
    assert third.headers["X-Cache-Slot"] != busy_slot
    assert "ignoring busy cache_key slot" in caplog.text
    page = await (await client.get("/metrics")).text()
    for outcome in ("reuse", "unsafe", "busy"):
        assert metric(page, "llama_cache_proxy_cache_key_total", outcome=outcome) >= 1


async def test_a_cache_key_yields_to_the_slot_holding_more_of_the_prompt(
    llama_servers: Any, proxy: Any
) -> None:
    """One session, two prompt threads sharing the system prompt (an agent and its user
    simulator), one slot each. The key follows the last request, to thread A's slot; thread B's
    next turn overlaps that slot enough to be safe, but its own slot holds far more: it goes
    there ("outmatched") and reuses its whole previous prompt, and thread A keeps its slot."""
    server = llama_servers(slots=2, extra=("--cache-ram", "0"))  # nothing parked in RAM
    client = await proxy(
        [{"url": server.url, "ram_cache": False}],
        disk={"prefix_cache": "off", "park": "off"},
    )

    async def send(messages: list[dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
        body = {"messages": messages, "max_tokens": 8, "temperature": 0}
        resp = await client.post("/v1/chat/completions", json={**body, "prompt_cache_key": "s"})
        assert resp.status == 200, await resp.text()
        return resp.headers, await resp.json()

    thread_b = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(1)}]
    b_headers, b_first = await send(thread_b)
    thread_a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(0)}]
    # the key maps to B's slot, which A overlaps (the system prompt) enough to be safe, but
    # the empty slot scores higher than overwriting B: A goes there, and the key follows it
    a_headers, _ = await send(thread_a)
    assert a_headers["X-Cache-Slot"] != b_headers["X-Cache-Slot"]
    reply = b_first["choices"][0]["message"]["content"]
    thread_b += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
    headers, body = await send(thread_b)
    assert headers["X-Cache-Slot"] == b_headers["X-Cache-Slot"]
    timings, before = body["timings"], b_first["timings"]
    assert timings["cache_n"] >= before["prompt_n"] + before["cache_n"] - 1
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_cache_key_total", outcome="outmatched") == 2


def test_two_proxy_processes_share_redis_and_keep_a_session(
    llama_servers: Any, redis_server: Any
) -> None:
    servers = [llama_servers(slots=2) for _ in range(2)]
    ports = [free_port(), free_port()]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy",
                "serve",
                "--listen",
                f"127.0.0.1:{port}",
                "--redis-url",
                redis_server.url,
                *[arg for s in servers for arg in ("--backend", s.url)],
            ],
            env={**os.environ, "LLAMA_CACHE_PROXY_LOG_LEVEL": "WARNING", **REPLICA_SECRET},
        )
        for port in ports
    ]
    try:
        for port, proc in zip(ports, procs, strict=True):
            wait_http(f"http://127.0.0.1:{port}/readyz", 30, proc)
        asyncio.run(until_listed([f"http://127.0.0.1:{port}" for port in ports]))
        history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(1)}]
        placed, replicas = [], set()
        previous = 0
        for turn in range(4):
            port = ports[turn % 2]
            body = {"messages": history, "max_tokens": 8, "temperature": 0}
            data, headers = _post(f"http://127.0.0.1:{port}/v1/chat/completions", body)
            placed.append((headers["X-Cache-Backend"], headers["X-Cache-Slot"]))
            replicas.add(headers["X-Cache-Replica"])
            if turn:
                timings = data["timings"]
                assert timings["cache_n"] >= 0.9 * previous, (turn, timings, placed, dict(headers))
            previous = data["timings"]["prompt_n"] + data["timings"]["cache_n"]
            history = [
                *history,
                {"role": "assistant", "content": data["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"Turn {turn}: continue."},
            ]
        assert len(set(placed)) == 1, placed
        # its backend's home scheduled every turn: the two that reached the other replica
        # were forwarded to it
        assert len(replicas) == 1, replicas
        pages = [_get(f"http://127.0.0.1:{port}/metrics") for port in ports]
        forwards = "llama_cache_proxy_forwarded_requests_total"
        assert sum(metric(p, forwards, outcome="sent") for p in pages) == 2
        assert sum(metric(p, forwards, outcome="received") for p in pages) == 2
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def _post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read()), resp.headers


async def test_a_short_prompt_repeated_whole_routes_as_a_prefix_hit(
    llama_servers: Any, proxy: Any
) -> None:
    """A raw prompt under ``min_prefix_tokens`` sent again after another request took its
    slot: the router counts its whole as a hit (route ``prefix``: from the slot or, here,
    the server's RAM cache) and the server reuses all of it but the token it re-evaluates."""
    server = llama_servers(slots=2)
    client = await proxy([server.url])
    short = {"prompt": "Please track my lost tablet order.", "max_tokens": 1, "temperature": 0}
    other = {"prompt": "Name three rivers in Europe.", "max_tokens": 1, "temperature": 0}
    assert (await client.post("/v1/completions", json=short)).status == 200
    assert (await client.post("/v1/completions", json=other)).status == 200
    again = await client.post("/v1/completions", json=short)
    timings = (await again.json())["timings"]
    assert again.headers["X-Cache-Route"] == "prefix"
    assert 0 < int(again.headers["X-Cache-Predicted-Tokens"]) < 16
    assert timings["cache_n"] == timings["prompt_n"] + timings["cache_n"] - 1


async def test_a_streamed_turn_continued_through_the_other_replica_keeps_its_slot(
    llama_servers: Any, proxy: Any, redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session's turn streams through replica A; its next turn goes through replica B as soon
    as the client reads ``[DONE]``, which A sends only after it gave the slot back and recorded
    it (Redis slowed to 0.3 s per lease release to widen the gap), so B reuses the slot's KV."""
    from proxy.state.redis import RedisStateStore

    original = RedisStateStore.release_lease

    async def slow(self: Any, ref: Any, owner: str) -> None:
        await asyncio.sleep(0.3)
        await original(self, ref, owner)

    monkeypatch.setattr(RedisStateStore, "release_lease", slow)
    server = llama_servers(slots=2)
    a = await proxy([server.url], redis_url=redis_server.url)
    b = await proxy([server.url], redis_url=redis_server.url)
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(0)}]
    body = {"messages": history, "max_tokens": 8, "temperature": 0, "stream": True}
    first = await a.post("/v1/chat/completions", json=body)
    events = await events_to_done(first)  # as an SDK reads it: not past [DONE]
    reply = delta_text(events)
    timings = next(e["timings"] for e in events if e.get("timings"))
    prompt = timings["prompt_n"] + timings["cache_n"]
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
    second = await b.post(
        "/v1/chat/completions", json={"messages": history, "max_tokens": 8, "temperature": 0}
    )
    assert second.status == 200
    assert second.headers["X-Cache-Slot"] == first.headers["X-Cache-Slot"]
    assert (await second.json())["timings"]["cache_n"] >= prompt - 1


async def test_new_sessions_sharing_a_system_prompt_start_at_once_on_empty_slots(
    llama_servers: Any, proxy: Any
) -> None:
    """While one new session streams on a slot, a second new session with the same long
    system prompt starts at once on the empty slot instead of waiting for the first one's
    slot, which it would not take once free (it holds another conversation): route ``cold``,
    not ``wait+cold``; a third one, when both slots hold such a conversation, reuses the
    prompt from one of them, routed "prefix". (There the disk tier's scoped save, seeing two
    requests share the system prompt, prefills and saves it before the second request: the
    log shows both prefills running at once.)"""
    server = llama_servers(slots=2)
    client = await proxy([server.url])
    system = SYSTEM * 3  # ~300 tokens: a saving the router would otherwise wait for

    def new_session(topic: str, **extra: Any) -> dict[str, Any]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": topic}]
        return {"messages": messages, "max_tokens": 48, "temperature": 0, **extra}

    first = await client.post(
        "/v1/chat/completions", json=new_session("Tell me about tides.", stream=True)
    )
    assert first.status == 200
    await first.content.readline()  # the first chunk: its request is in flight on a slot
    second = await client.post("/v1/chat/completions", json=new_session("Explain rainbows."))
    assert second.status == 200, await second.text()
    await events_to_done(first)
    assert second.headers["X-Cache-Route"] == "cold"
    assert second.headers["X-Cache-Slot"] != first.headers["X-Cache-Slot"]
    await second.json()
    # both slots now hold another conversation with the system prompt: a third new session
    # takes the least valuable one, which serves the prompt, and the route says "prefix"
    third = await client.post("/v1/chat/completions", json=new_session("Why is the sky blue?"))
    assert third.headers["X-Cache-Route"] == "prefix"
    assert (await third.json())["timings"]["cache_n"] >= 250


@pytest.mark.parametrize("idle_saves", [True, False])
async def test_the_ram_cache_model_follows_idle_slot_saves(
    llama_servers: Any, proxy: Any, idle_saves: bool
) -> None:
    """Room for two short parked prompts or one long one (``--cache-ram 2``): a long prompt
    X stays in slot 0 while alpha, beta, gamma take turns in slot 1, then beta returns. With
    ``--cache-idle-slots`` (the default) each task saves X's idle slot too, which pushes
    beta out; with ``--no-cache-idle-slots`` beta is still parked. Told how the server runs
    (``cache_idle_slots``), the proxy predicts either outcome."""
    flags = ("--cache-ram", "2") + (() if idle_saves else ("--no-cache-idle-slots",))
    server = llama_servers(slots=2, extra=flags)
    backend = {"url": server.url, "ram_cache_tokens": 91, "cache_idle_slots": idle_saves}
    client = await proxy(
        [backend], routing={"max_slot_wait_seconds": 0}, disk={"prefix_cache": "off", "park": "off"}
    )

    def text(word: str) -> str:
        return f"Budget {word} words about orchards and their tall trees. " * 3

    for word in ("xi", "alpha", "beta", "gamma", "beta"):
        prompt = text(word) * (2 if word == "xi" else 1)
        resp = await client.post("/completion", json={"prompt": prompt, "n_predict": 2})
        assert resp.status == 200, await resp.text()
        cached = (await resp.json())["timings"]["cache_n"]
        predicted = int(resp.headers["X-Cache-Predicted-Tokens"])
        slot = resp.headers["X-Cache-Slot"]
        assert slot == ("0" if word == "xi" else "1"), (word, slot)  # X's slot is kept
    # beta's return: parked (most of it reused, and predicted) only without idle saves
    assert (cached > 20) is not idle_saves, cached
    assert abs(predicted - cached) <= 4, (predicted, cached)


@pytest.mark.parametrize("reply", [1, 48])
async def test_a_raw_prompts_ram_copy_counts_its_reply(
    llama_servers: Any, proxy: Any, reply: int
) -> None:
    """llama-server saves a raw prompt's slot with the reply it generated, and loads a RAM
    entry only for a prompt that keeps at least a quarter of it. A short prompt P, parked by
    another conversation, is loaded for P's continuation (a new paragraph after it) when
    its reply was one token, and not when it was 48 (P keeps under a quarter of P + reply).
    The proxy predicts both: it counts the slot's real length, reply included, and sees P
    shared whole (raw prompts are fingerprinted by paragraph); before, it predicted the
    load either way."""
    server = llama_servers(slots=1)
    client = await proxy(
        [server.url],
        routing={"max_slot_wait_seconds": 0},
        disk={"prefix_cache": "off", "park": "off"},
    )
    first = "Tell me about the orchards and the tall trees in spring."
    other = "A different conversation about rivers, bridges and the boats upon them. " * 3
    then = first + "\n\n" + "And which apples grow best in the cold northern valleys? " * 3
    for prompt, n_predict in ((first, reply), (other, 4), (then, 2)):
        body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True}
        resp = await client.post("/completion", json=body)
        assert resp.status == 200, await resp.text()
    cached = (await resp.json())["timings"]["cache_n"]
    predicted = int(resp.headers["X-Cache-Predicted-Tokens"])
    assert (cached >= 10) is (reply == 1), cached  # loaded only without the long reply
    assert abs(predicted - cached) <= 3, (predicted, cached)


async def test_token_id_prompts_route_to_the_slot_holding_their_prefix(
    llama_servers: Any, proxy: Any
) -> None:
    """Raw prompts sent as token ids (from the server's own ``/tokenize``), two sessions
    alternating on two slots: each next prompt, its previous one extended, goes to the slot
    holding it and is predicted as the server then reuses it; a list mixing text and ids is
    served as text."""
    server = llama_servers(slots=2)
    client = await proxy([server.url], routing={"max_slot_wait_seconds": 0})
    ids: dict[str, list[int]] = {}
    async with aiohttp.ClientSession() as direct:
        for topic in ("orchards", "rivers"):
            text = f"Notes on {topic}: " + " ".join(f"{topic} fact {i} is kept." for i in range(30))
            async with direct.post(f"{server.url}/tokenize", json={"content": text}) as resp:
                ids[topic] = (await resp.json())["tokens"]
    previous: dict[str, int] = {}
    for turn in range(3):
        for topic in ids:
            ids[topic] = prompt = ids[topic] + ids[topic][:24]  # extends the previous turn
            body = {"prompt": prompt, "n_predict": 2, "temperature": 0}
            resp = await client.post("/completion", json=body)
            assert resp.status == 200, await resp.text()
            cached = (await resp.json())["timings"]["cache_n"]
            if turn:
                assert resp.headers["X-Cache-Route"] == "prefix"
                assert cached >= 0.9 * previous[topic], (turn, topic, cached)
                predicted = int(resp.headers["X-Cache-Predicted-Tokens"])
                assert previous[topic] - 16 <= predicted <= cached + 1, (predicted, cached)
            previous[topic] = len(prompt)
    mixed = {"prompt": ["Name a river.", ids["rivers"][:5]], "n_predict": 2}
    assert (await client.post("/completion", json=mixed)).status == 200


async def test_a_saving_under_the_bar_does_not_wait_for_its_busy_slot(
    llama_servers: Any, proxy: Any
) -> None:
    """One slot holds an unrelated prompt, the other streams a 32-token reply to a ~120-token
    prompt. A prompt extending that one to ~450 tokens shares a quarter of it: under the bar
    of half the prompt, not worth a wait. The request starts at once on the other slot, cold
    (the server parks the unrelated prompt in its RAM cache)."""
    server = llama_servers(slots=2)
    client = await proxy([server.url])

    def completion(prompt: str, **extra: Any) -> dict[str, Any]:
        return {"prompt": prompt, "max_tokens": 32, "temperature": 0, **extra}

    other = await client.post("/completion", json=completion(opening(1)))
    assert other.status == 200
    await other.json()
    first = await client.post("/completion", json=completion(SYSTEM, stream=True))
    assert first.status == 200
    await first.content.readline()  # in flight on the other slot
    longer = completion(SYSTEM + " ".join([opening(2)] * 3))
    second = await client.post("/completion", json=longer)
    assert second.status == 200, await second.text()
    async for _ in first.content:
        pass
    cached = (await second.json())["timings"]["cache_n"]
    assert second.headers["X-Cache-Route"] == "cold"
    assert second.headers["X-Cache-Slot"] == other.headers["X-Cache-Slot"]
    assert cached < 20


def agent_body(system: str, user: str, tools: bool = True) -> dict[str, Any]:
    tool = {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "temperature": 0,
    }
    return {**body, "tools": [tool]} if tools else body


SESSION_RULES = " ".join(f"Rule {i}: keep change {i} small and tested." for i in range(100))
SESSION_SYSTEM = f"You are a coding agent. {SESSION_RULES}\nRuntime: session="


def unrelated(notes: int) -> dict[str, Any]:
    """An unrelated prompt of ``notes`` sentences (about 10 tokens each), without tools."""
    text = " ".join(f"Unrelated note {i} about the weather." for i in range(notes))
    return agent_body(text, "Summarise.", tools=False)


async def beta_after(client: Any, *before: dict[str, Any]) -> None:
    """``before``, then a new session "beta" under the session system prompt: the server
    reuses at least 80 % of its prompt, and the proxy predicted that within 10 %."""
    for body in before:
        first = await client.post("/v1/chat/completions", json=body)
        assert first.status == 200, await first.text()
    body = agent_body(SESSION_SYSTEM + "beta", "Fix bug 2.")
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    answer = await resp.json()
    cached, prompt = answer["timings"]["cache_n"], answer["usage"]["prompt_tokens"]
    predicted = int(resp.headers["X-Cache-Predicted-Tokens"])
    print(f"new session: cache_n {cached} of {prompt}, predicted {predicted}")
    assert cached >= 0.8 * prompt, (cached, prompt)
    assert abs(predicted - cached) <= 0.1 * cached, (predicted, cached)


async def test_sessions_whose_system_prompts_part_in_a_last_line_share_the_rest(
    llama_servers: Any, proxy: Any
) -> None:
    """Agents that end the system prompt with a line of their own (a session id, as
    OpenClaw's Responses API requests do): a new session's prompt shares all of another's
    system prompt but that line, to the token. Both slots are taken, one by that session, one
    by an unrelated long prompt used before it: the new session takes the first, whose loss
    beyond the system prompt is a short user message, and the server reuses the system
    prompt there, as predicted (without looking into the message, the two slots looked
    alike and the least recently used went: a cold start). The unrelated prompt is long
    enough that parking it (a tenth of it counted as lost) costs more than the session's own
    tail: with one half as long the two choices score within a token of each other, and
    how long the session's turn took decides."""
    client = await proxy([llama_servers(slots=2).url])
    alpha = agent_body(SESSION_SYSTEM + "alpha", "Fix bug 1.")
    await beta_after(client, unrelated(120), alpha)


async def test_a_session_parked_in_ram_serves_one_whose_system_prompt_parts_in_a_last_line(
    llama_servers: Any, proxy: Any
) -> None:
    """The server's RAM prompt cache compares tokens too: on one slot, a session parked there
    by an unrelated prompt is loaded for a new session whose system prompt differs from its
    own only in a last line, and the prediction counts it (by whole segments the entry shared
    the tools alone, under a quarter of it, and the request was predicted cold)."""
    client = await proxy([llama_servers(slots=1).url])
    alpha = agent_body(SESSION_SYSTEM + "alpha", "Fix bug 1.")
    await beta_after(client, alpha, unrelated(60))  # the unrelated prompt parks alpha in RAM

"""Prefix- and session-aware routing across a fleet of fake llama-servers."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from testbed.probes import metric
from tests.waiting import until

SYSTEM = "You are a coding agent. Follow the rules. " * 40


def session_turn(session: int, turn: int, history: list[dict[str, Any]]) -> dict[str, Any]:
    user = {"role": "user", "content": f"session {session} question {turn}: " + "detail " * 30}
    return {
        "messages": [{"role": "system", "content": SYSTEM}, *history, user],
        "max_tokens": 8,
        "stream": turn % 2 == 0,
        "stream_options": {"include_usage": True},
    }


async def _run_turn(client: Any, body: dict[str, Any]) -> tuple[str, dict[str, Any], Any]:
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    text = await resp.text()
    if body["stream"]:
        import json

        events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
        reply = "".join(
            (e["choices"][0]["delta"].get("content") or "") for e in events if e.get("choices")
        )
        timings = next(e["timings"] for e in events if "timings" in e)
    else:
        import json

        data = json.loads(text)
        reply, timings = data["choices"][0]["message"]["content"], data["timings"]
    return reply, timings, resp.headers


async def test_interleaved_sessions_keep_their_slots(fakes: Any, proxy: Any) -> None:
    backends = [await fakes(n_slots=2) for _ in range(2)]
    client = await proxy(backends)
    histories: dict[int, list[dict[str, Any]]] = {s: [] for s in range(4)}
    previous: dict[int, int] = {}
    order = [s for _ in range(4) for s in random.Random(7).sample(range(4), 4)]
    turns = {s: 0 for s in range(4)}
    errors = []
    for session in order:
        body = session_turn(session, turns[session], histories[session])
        reply, timings, headers = await _run_turn(client, body)
        prompt = timings["prompt_n"] + timings["cache_n"]
        if session in previous:
            assert timings["cache_n"] >= 0.9 * previous[session], (session, timings)
            assert headers["X-Cache-Route"] in ("prefix", "affinity")
            predicted = int(headers["X-Cache-Predicted-Tokens"])  # in the backend's tokens
            errors.append(abs(predicted - timings["cache_n"]) / timings["cache_n"])
        previous[session] = prompt
        histories[session] += [body["messages"][-1], {"role": "assistant", "content": reply}]
        turns[session] += 1
    assert all(b.violations == [] for b in backends)
    assert sorted(errors)[len(errors) // 2] < 0.15  # tiktoken estimates, calibrated per backend
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_route_decisions_total", reason="prefix") >= 12


async def test_more_sessions_than_slots_still_all_complete(fakes: Any, proxy: Any) -> None:
    backends = [await fakes(n_slots=2, gen_s_per_token=0.001) for _ in range(2)]
    client = await proxy(backends)
    histories: dict[int, list[dict[str, Any]]] = {s: [] for s in range(8)}
    for turn in range(3):
        bodies = [session_turn(s, turn, histories[s]) for s in range(8)]
        results = await asyncio.gather(*(_run_turn(client, b) for b in bodies))
        for s, (reply, _, _) in enumerate(results):
            histories[s] += [bodies[s]["messages"][-1], {"role": "assistant", "content": reply}]
    assert all(b.violations == [] for b in backends)


async def test_openclaw_carrier_turns_stay_on_their_slot(fakes: Any, proxy: Any) -> None:
    """Turn N is not a prefix of N+1 (transient last message): message-level matching."""
    fake = await fakes(n_slots=2)
    client = await proxy([fake])
    carrier = {"role": "user", "content": [{"type": "text", "text": "<<<CTX>>> " + "x " * 20}]}
    first = "[Sun 2026-11-22 03:31 UTC] hi\n\nRuntime: sessionId=s1 " + "y " * 40
    history: list[dict[str, Any]] = [{"role": "user", "content": first}]
    slots = []
    for turn in range(4):
        body = {
            "messages": [{"role": "system", "content": SYSTEM}, *history, carrier],
            "max_tokens": 6,
            "stream": True,
        }
        reply, timings, headers = await _run_turn(client, body)
        slots.append(headers["X-Cache-Slot"])
        if turn:
            assert timings["cache_n"] > 0.8 * (timings["prompt_n"] + timings["cache_n"])
        history += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"[Sun 2026-11-22 03:3{turn + 2} UTC] next"},
        ]
    assert len(set(slots)) == 1


async def test_cache_key_reuse_unsafe_and_busy_cases(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=2, gen_s_per_token=0.01)
    client = await proxy([fake])
    base: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "topic A " * 20},
        ],
        "max_tokens": 4,
        "prompt_cache_key": "k1",
    }
    first = await client.post("/v1/chat/completions", json=base)
    slot = first.headers["X-Cache-Slot"]
    follow = {**base, "messages": [*base["messages"], {"role": "user", "content": "more"}]}
    again = await client.post("/v1/chat/completions", json=follow)
    assert again.headers["X-Cache-Route"] == "affinity"
    assert again.headers["X-Cache-Slot"] == slot
    unrelated = {
        "messages": [{"role": "user", "content": "totally different"}],
        "max_tokens": 4,
        "prompt_cache_key": "k1",
    }
    other = await client.post("/v1/chat/completions", json=unrelated)
    assert other.headers["X-Cache-Route"] != "affinity"
    # busy mapped slot: a long request holds it, the keyed request routes elsewhere
    keyed_slot = other.headers["X-Cache-Slot"]
    hold = {**unrelated, "max_tokens": 60, "prompt_cache_key": "k2"}
    hold["messages"] = [{"role": "user", "content": "totally different and longer"}]
    pending = asyncio.create_task(client.post("/v1/chat/completions", json=hold))
    await until(lambda: any(s.busy for s in fake.slots), "the long request runs")
    page = await (await client.get("/metrics")).text()
    third = await client.post("/v1/chat/completions", json={**unrelated, "max_tokens": 2})
    assert third.status == 200
    await pending
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_cache_key_total", outcome="reuse") >= 1
    assert metric(page, "llama_cache_proxy_cache_key_total", outcome="unsafe") >= 1
    assert keyed_slot in ("0", "1")
    assert fake.violations == []


async def test_admin_slot_table_needs_the_token(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=2)
    off = await proxy([fake])
    assert (await off.get("/admin/slots")).status == 404
    client = await proxy([fake], admin_token="s3cret")
    await client.post("/v1/chat/completions", json=session_turn(0, 1, []))
    assert (await client.get("/admin/slots")).status == 401
    bad = await client.get("/admin/slots", headers={"Authorization": "Bearer nope"})
    assert bad.status == 401
    resp = await client.get("/admin/slots", headers={"Authorization": "Bearer s3cret"})
    table = await resp.json()
    slots = table["backends"][0]["slots"]
    assert sorted(s["phase"] for s in slots) == ["idle", "idle"]
    assert max(s["estimated_tokens"] for s in slots) > 300
    assert max(s["kv_tokens"] for s in slots) > 300


async def test_backend_tokenizer_counts_segments_with_the_backend(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=1)
    client = await proxy([fake], routing={"tokenizer": "backend"}, disk={"prefix_cache": "off"})
    body = session_turn(0, 1, [])
    await client.post("/v1/chat/completions", json=body)
    first_calls = fake.tokenize_calls
    again = await client.post("/v1/chat/completions", json=body)
    assert first_calls >= 2  # system and user segments counted by the backend
    assert fake.tokenize_calls == first_calls  # cached per text afterwards
    predicted = int(again.headers["X-Cache-Predicted-Tokens"])
    actual = (await again.json())["timings"]["cache_n"]
    assert abs(predicted - actual) <= 16  # backend counts plus template overhead


async def _agents(
    client: Any, turns: int, **extra: Any
) -> list[tuple[int, int, dict[str, Any], Any]]:
    """Three sessions sharing a long system prompt, most of each one's content as in agent
    fleets, taking ``turns`` interleaved turns (``extra``: body fields, or a callable of the
    turn giving them); each turn's (session, turn, timings, headers)."""
    histories: dict[int, list[dict[str, Any]]] = {s: [] for s in range(3)}
    out = []
    for turn in range(turns):
        for session in range(3):
            user = {"role": "user", "content": f"session {session} turn {turn}: " + "log " * 100}
            messages = [{"role": "system", "content": SYSTEM * 4}, *histories[session], user]
            fields = {k: v(turn) if callable(v) else v for k, v in extra.items()}
            body = {"messages": messages, "max_tokens": 8, "stream": False, **fields}
            reply, timings, headers = await _run_turn(client, body)
            out.append((session, turn, timings, headers))
            histories[session] += [user, {"role": "assistant", "content": reply}]
    return out


async def test_a_session_parked_in_ram_comes_back_through_a_primer(fakes: Any, proxy: Any) -> None:
    """Three sessions sharing a long system prompt take turns on one backend of two slots,
    with the RAM cache and no disk tier: each returning turn finds its slot holding another
    session, which keeps over half of it, so the server would not consult its cache. The
    proxy sends a primer first; the server parks the other session and loads this one, and
    every returning turn reuses its own history, as predicted."""
    fake = await fakes(n_slots=2)
    client = await proxy([fake])
    previous: dict[int, int] = {}
    for session, turn, timings, headers in await _agents(client, 3):
        if session in previous:
            assert timings["cache_n"] >= 0.95 * previous[session], (session, turn, timings)
            predicted = int(headers["X-Cache-Predicted-Tokens"])
            assert abs(predicted - timings["cache_n"]) <= 0.1 * timings["cache_n"]
        previous[session] = timings["prompt_n"] + timings["cache_n"]
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_ram_primers_total", outcome="sent") >= 4
    assert fake.violations == []


async def test_a_failed_primer_is_counted_and_the_request_goes_on(
    fakes: Any, proxy: Any, monkeypatch: Any
) -> None:
    """The primer fails (the server answers an error): the request is sent all the same, and
    reuses what the slot itself holds."""
    from proxy.upstream import LlamaServerClient, SlotActionFailed

    async def failing(*args: Any) -> None:
        raise SlotActionFailed("/completion: 500 no")

    monkeypatch.setattr(LlamaServerClient, "prime", failing)
    client = await proxy([await fakes(n_slots=2)])
    assert len(await _agents(client, 2)) == 6
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_ram_primers_total", outcome="failed") >= 1
    assert metric(page, "llama_cache_proxy_ram_primers_total", outcome="sent") == 0


async def test_no_primer_for_a_request_that_reuses_nothing(fakes: Any, proxy: Any) -> None:
    """A client's ``cache_prompt: false`` reuses nothing: no primer is sent for it, and none
    of its tokens is predicted cached."""
    client = await proxy([await fakes(n_slots=2)])
    for _, turn, timings, headers in await _agents(client, 2, cache_prompt=lambda t: t == 0):
        assert turn == 0 or timings["cache_n"] == int(headers["X-Cache-Predicted-Tokens"]) == 0
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_ram_primers_total", outcome="sent") == 0


async def test_no_primer_where_slots_are_not_pinned(fakes: Any, proxy: Any) -> None:
    """With ``routing.pin_slots: false`` the server picks the slot, maybe another than the
    primer's: no primer is sent."""
    client = await proxy([await fakes(n_slots=2)], routing={"pin_slots": False})
    assert len(await _agents(client, 2)) == 6
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_ram_primers_total", outcome="sent") == 0

"""A slot a session just left is held for its next turn on a backend without a RAM cache."""

from __future__ import annotations

import asyncio
from typing import Any

from testbed.probes import metric
from tests.waiting import once_placed

SYSTEM = "You are a coding agent. Follow the rules. " * 10


def turn(session: str, history: list[dict[str, Any]], text: str, tokens: int = 8) -> dict[str, Any]:
    user = {"role": "user", "content": f"{session}: {text} " + "detail " * 150}
    messages = [{"role": "system", "content": SYSTEM}, *history, user]
    return {"messages": messages, "max_tokens": tokens, "temperature": 0}


async def post(client: Any, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json(), resp.headers


async def two_sessions(client: Any, first_tokens: int = 8) -> tuple[int, int, Any]:
    """A's first turn (``first_tokens`` long) runs while B queues; A sends its next turn as
    soon as it has the reply. Returns A's first prompt size, what A's second turn reused,
    and B's headers."""
    first_body = turn("A", [], "start", first_tokens)
    first_task = await once_placed(post(client, first_body), client)  # A's first turn runs
    other = asyncio.create_task(post(client, turn("B", [], "hello")))
    first, _ = await first_task
    reply = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    history = [first_body["messages"][1], reply]
    second, _ = await post(client, turn("A", history, "next"))
    _, b_headers = await other
    size = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
    return size, second["timings"]["cache_n"], b_headers


async def lone_backend(fakes: Any) -> Any:
    """One slot, no RAM prompt cache (``--cache-ram 0``), prefill and decode that take time."""
    return await fakes(n_slots=1, ram_cache=False, gen_s_per_token=0.05, prompt_s_per_token=5e-4)


async def test_a_session_gets_its_slot_back_before_a_waiting_stranger(
    fakes: Any, proxy: Any
) -> None:
    backend = await lone_backend(fakes)
    client = await proxy([{"url": backend.url, "ram_cache": False}])
    size, reused, b_headers = await two_sessions(client)
    assert reused >= 0.9 * size  # A's history stayed in the slot
    assert b_headers["X-Cache-Route"].startswith("wait")  # B waited, then ran
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_slot_hold_waits_total") >= 1


async def test_without_holds_the_stranger_takes_the_slot(fakes: Any, proxy: Any) -> None:
    backend = await lone_backend(fakes)
    client = await proxy(
        [{"url": backend.url, "ram_cache": False}], routing={"max_slot_wait_seconds": 0}
    )
    size, reused, _ = await two_sessions(client)
    assert reused < 0.5 * size  # B overwrote A's history: only the system prompt is shared


async def test_a_held_slot_goes_to_the_waiter_when_its_session_does_not_come_back(
    fakes: Any, proxy: Any
) -> None:
    backend = await lone_backend(fakes)
    client = await proxy([{"url": backend.url, "ram_cache": False}], queue={"max_wait_seconds": 30})
    first = await once_placed(post(client, turn("A", [], "start")), client)
    _, b_headers = await post(client, turn("B", [], "hello"))  # A never comes back
    await first
    assert b_headers["X-Cache-Route"].startswith("wait")
    assert int(b_headers["X-Cache-Slot"]) == 0
    page = await (await client.get("/metrics")).text()  # B waited once, then was placed
    assert metric(page, "llama_cache_proxy_route_decisions_total", reason="wait") == 1


async def test_a_request_waiting_beside_a_held_slot_takes_it_when_the_hold_ends(
    fakes: Any, proxy: Any
) -> None:
    """Session A's turn runs on one slot; B's turn ends on another, which is then held for
    B; the third holds another agent's session. C continues A's conversation: waiting for
    A's slot beats overwriting the other agent's, but once B's hold ends, B's slot (the same
    long system prompt) serves nearly as much, so C takes it then rather than waiting for
    A's turn to end."""
    backend = await fakes(n_slots=3, ram_cache=False, gen_s_per_token=0.05, prompt_s_per_token=5e-4)
    client = await proxy(
        [{"url": backend.url, "ram_cache": False}],
        routing={"max_slot_wait_seconds": 20},
        queue={"max_wait_seconds": 30},
    )

    def body(system: str, *texts: str, tokens: int = 2) -> dict[str, Any]:
        users = [{"role": "user", "content": text} for text in texts]
        messages = [{"role": "system", "content": system * 10}, *users]  # most of each prompt
        return {"messages": messages, "max_tokens": tokens, "temperature": 0}

    _, x_headers = await post(client, body("You review pull requests. " * 8, "X: review"))
    a_task = await once_placed(post(client, body(SYSTEM, "A: start", tokens=80)), client)  # ~4 s
    _, b_headers = await post(client, body(SYSTEM, "B: hello " + "detail " * 60))  # held
    _, c_headers = await post(client, body(SYSTEM, "A: start", "A: and then"))
    assert not a_task.done()  # placed before A's turn ended
    assert c_headers["X-Cache-Route"] == "wait+prefix"
    assert c_headers["X-Cache-Slot"] == b_headers["X-Cache-Slot"]
    _, a_headers = await a_task
    slots = {x_headers["X-Cache-Slot"], a_headers["X-Cache-Slot"], b_headers["X-Cache-Slot"]}
    assert len(slots) == 3

"""A batch ``prompt`` through the proxy on the real llama-server.

llama-server makes one task of each element of a batch and gives every one the request's
``id_slot``; pinned, every element after the first waits for a busy slot (where the
server's RAM-cache hook may swap state under a running generation). The proxy sends a batch
unpinned on a backend of its own: the elements run on distinct slots, each answer equal to
the element's own answer from the server.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from testbed.probes import metric

PROMPTS = ["Count with me: 1, 2, 3, 4,", "The three primary colours are"]
GREEDY = {"n_predict": 12, "temperature": 0, "seed": 1}


async def _alone(url: str, prompt: str) -> str:
    body = {"prompt": prompt, **GREEDY, "cache_prompt": False}
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return str((await resp.json())["content"])


async def test_batch_elements_run_on_distinct_slots_with_their_own_answers(
    llama_servers: Any, proxy: Any
) -> None:
    server = llama_servers(slots=2)
    client = await proxy([server])
    expected = [await _alone(server.url + "/completion", p) for p in PROMPTS]
    resp = await client.post("/completion", json={"prompt": PROMPTS, **GREEDY})
    assert resp.status == 200, await resp.text()
    results = await resp.json()
    assert [r["content"] for r in results] == expected
    assert len({r["id_slot"] for r in results}) == 2  # pinned, both ran on one slot

    body = {"prompt": PROMPTS, **GREEDY, "stream": True, "max_tokens": 12}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    texts = ["", ""]
    for event in (await resp.text()).split("\n\n"):
        payload = event.removeprefix("data: ").strip()
        if payload and payload != "[DONE]":
            data = json.loads(payload)  # (the server sends "data: null" between elements)
            for choice in data.get("choices", []) if data else []:
                texts[choice["index"]] += choice.get("text") or ""
    assert texts == expected


async def test_the_server_pins_every_element_to_the_requests_slot(llama_servers: Any) -> None:
    """What the fake models (``tests/integration/test_batches.py``): sent straight to the
    server with ``id_slot``, every element runs on that slot, one after another."""
    server = llama_servers(slots=2)
    body = {"prompt": PROMPTS, **GREEDY, "id_slot": 0}
    async with (
        aiohttp.ClientSession() as session,
        session.post(server.url + "/completion", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
        results = await resp.json()
    assert [r["id_slot"] for r in results] == [0, 0]


async def test_a_prompt_object_answers_as_its_text(llama_servers: Any, proxy: Any) -> None:
    """llama-server's ``{"prompt_string": ...}`` form through the proxy: the answer of the
    text itself."""
    server = llama_servers(slots=2)
    client = await proxy([server])
    expected = await _alone(server.url + "/completion", PROMPTS[0])
    resp = await client.post(
        "/completion", json={"prompt": {"prompt_string": PROMPTS[0]}, **GREEDY}
    )
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["content"] == expected


async def _counted(client: Any) -> tuple[float, float]:
    text = await (await client.get("/metrics")).text()
    return (
        metric(text, "llama_cache_proxy_prompt_tokens_total"),
        metric(text, "llama_cache_proxy_cached_tokens_total"),
    )


def _carrying(field: str, stream: str) -> list[dict[str, Any]]:
    """``field`` of each event of ``stream`` that has it (the server sends "data: null"
    between a batch's elements)."""
    found = []
    for event in stream.split("\n\n"):
        payload = event.removeprefix("data: ").strip()
        data = json.loads(payload) if payload and payload != "[DONE]" else None
        if data and data.get(field):
            found.append(data[field])
    return found


async def test_a_batch_counts_every_elements_tokens(llama_servers: Any, proxy: Any) -> None:
    """The hit rate's counters take every task of a batch: each element of a non-streamed
    answer's list, and each task's final chunk of a stream (they counted none, and the
    first, of the server's own counts)."""
    server = llama_servers(slots=2)
    client = await proxy([server])
    before = await _counted(client)
    resp = await client.post("/completion", json={"prompt": PROMPTS, **GREEDY})
    assert resp.status == 200, await resp.text()
    timings = [r["timings"] for r in await resp.json()]
    server_counts = (
        sum(t["prompt_n"] + t["cache_n"] for t in timings),
        sum(t["cache_n"] for t in timings),
    )
    after = await _counted(client)
    assert (after[0] - before[0], after[1] - before[1]) == server_counts

    body = {"prompt": PROMPTS, **GREEDY, "stream": True, "max_tokens": 12}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    finals = _carrying("usage", await resp.text())
    assert len(finals) == len(PROMPTS)
    server_counts = (
        sum(u["prompt_tokens"] for u in finals),
        sum(u["prompt_tokens_details"]["cached_tokens"] for u in finals),
    )
    later = await _counted(client)
    assert (later[0] - after[0], later[1] - after[1]) == server_counts


async def test_streamed_choices_with_include_usage_count_every_task(
    llama_servers: Any, proxy: Any
) -> None:
    """With ``stream_options.include_usage`` each task's usage comes in a chunk of its own
    whose ``choices`` is empty, naming no task: each of them counts, once (they counted as
    one task, the last; with ``n`` 1 the one chunk counts once)."""
    server = llama_servers(slots=2)
    client = await proxy([server])
    chat = {"messages": [{"role": "user", "content": "Name three colours."}], "temperature": 0}
    for n in (2, 1):
        before = await _counted(client)
        body = {**chat, "n": n, "max_tokens": 4, "stream": True}
        resp = await client.post(
            "/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}}
        )
        assert resp.status == 200, await resp.text()
        timings = _carrying("timings", await resp.text())
        assert len(timings) == n  # one chunk with the server's timings per task
        server_counts = (
            sum(t["prompt_n"] + t["cache_n"] for t in timings),
            sum(t["cache_n"] for t in timings),
        )
        after = await _counted(client)
        assert (after[0] - before[0], after[1] - before[1]) == server_counts

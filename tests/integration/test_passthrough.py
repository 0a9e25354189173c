"""The proxy is indistinguishable from a llama-server, except for the fields it owns."""

from __future__ import annotations

import json
from typing import Any

import pytest

from testbed.probes import metric
from tests.conftest import chat
from tests.waiting import until_metric

COMPLETION_PATHS = [
    ("/v1/chat/completions", chat("hello there")),
    ("/chat/completions", chat("hello there")),
    ("/v1/completions", {"prompt": "once upon a time"}),
    ("/completion", {"prompt": "once upon a time"}),
    ("/completions", {"prompt": "once upon a time"}),
    ("/v1/responses", {"input": "say hi"}),
    ("/infill", {"input_prefix": "def f(", "input_suffix": "):", "prompt": ""}),
]


@pytest.mark.parametrize(("path", "body"), COMPLETION_PATHS, ids=[p for p, _ in COMPLETION_PATHS])
async def test_completion_body_forwarded_with_only_owned_fields_added(
    fakes: Any, proxy: Any, path: str, body: dict[str, Any]
) -> None:
    fake = await fakes()
    client = await proxy([fake])
    sent = {**body, "temperature": 0, "some_unknown_field": {"x": [1, 2]}}
    resp = await client.post(path, json=sent)
    assert resp.status == 200, await resp.text()
    got_path, forwarded, _ = fake.received[-1]
    assert got_path == path
    assert forwarded.pop("id_slot") in (0, 1)
    assert forwarded.pop("cache_prompt") is True
    assert forwarded == sent
    assert resp.headers["X-Cache-Slot"] in ("0", "1")


async def test_client_id_slot_is_ignored_by_default(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=2)
    client = await proxy([fake])
    for _ in range(3):
        resp = await client.post("/completion", json={"prompt": "x y", "id_slot": 1})
        assert resp.status == 200
    # the proxy's choice, not the client's: the repeated prompt stays on the slot holding it
    assert [b["id_slot"] for _, b, _ in fake.received] == [0, 0, 0]


async def test_client_id_slot_honoured_when_configured(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=2)
    client = await proxy([fake], routing={"honor_client_id_slot": True})
    for _ in range(2):
        assert (await client.post("/completion", json={"prompt": "x", "id_slot": 1})).status == 200
    assert [b["id_slot"] for _, b, _ in fake.received] == [1, 1]
    resp = await client.post("/completion", json={"prompt": "x", "id_slot": 7})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "id_slot"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/tokenize", {"content": "hello world"}),
        ("POST", "/apply-template", chat("hi")),
        ("GET", "/v1/models", None),
        ("GET", "/models", None),
        ("GET", "/props", None),
    ],
)
async def test_slotless_endpoints_pass_through_unchanged(
    fakes: Any, proxy: Any, method: str, path: str, body: Any
) -> None:
    fake = await fakes()
    client = await proxy([fake])
    resp = await client.request(method, path, json=body)
    assert resp.status == 200
    direct = await _direct(fake.url, method, path, body)
    assert await resp.json() == direct


async def _direct(url: str, method: str, path: str, body: Any) -> Any:
    import aiohttp

    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url + path, json=body) as resp,
    ):
        return await resp.json()


async def test_detokenize_roundtrip(fakes: Any, proxy: Any) -> None:
    client = await proxy([await fakes()])
    tokens = (await (await client.post("/tokenize", json={"content": "a b c"})).json())["tokens"]
    resp = await client.post("/detokenize", json={"tokens": tokens})
    assert (await resp.json())["content"] == "a b c"


async def test_messages_endpoint_is_pinned_as_a_chat_completion(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=2)
    client = await proxy([fake])
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 200
    path, sent, _ = fake.received[-1]
    assert path == "/v1/chat/completions"
    assert sent["id_slot"] == int(resp.headers["X-Cache-Slot"])


async def test_n_above_one_claims_the_backend_and_lets_the_server_choose(
    fakes: Any, proxy: Any
) -> None:
    fake = await fakes(n_slots=2)
    client = await proxy([fake])
    resp = await client.post("/completion", json={"prompt": "abc", "n": 2})
    assert resp.status == 200
    assert "id_slot" not in fake.received[-1][1]
    assert fake.violations == []


async def test_stream_relayed_and_usage_counted(fakes: Any, proxy: Any) -> None:
    fake = await fakes()
    client = await proxy([fake])
    body = chat("one two three", stream=True, stream_options={"include_usage": True})
    first = await (await client.post("/v1/chat/completions", json=body)).text()
    second = await (await client.post("/v1/chat/completions", json=body)).text()
    third = await (await client.post("/v1/chat/completions", json=body)).text()
    assert first.endswith("data: [DONE]\n\n")
    assert first.count("data: ") == second.count("data: ") == third.count("data: ")
    page = await (await client.get("/metrics")).text()
    prompt = metric(page, "llama_cache_proxy_prompt_tokens_total")
    cached = metric(page, "llama_cache_proxy_cached_tokens_total")
    # third request reuses the first one's slot (LRU): all but one prompt token cached
    last = _timings(third)
    assert cached == last["cache_n"] + _cache_n(second)
    assert prompt == 3 * (last["prompt_n"] + last["cache_n"])
    assert metric(page, "llama_cache_proxy_time_to_first_token_seconds_count") == 3


async def test_stream_usage_counted_before_the_client_sees_its_end(fakes: Any, proxy: Any) -> None:
    fake = await fakes()
    fake.linger_s = 2.0  # the upstream stream stays open after its last event
    client = await proxy([fake])
    body = chat("one two three", stream=True, stream_options={"include_usage": True})
    resp = await client.post("/v1/chat/completions", json=body)
    async for line in resp.content:  # a client stops reading at [DONE], as OpenClaw does
        if line.startswith(b"data: [DONE]"):
            break
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_prompt_tokens_total") > 0
    assert metric(page, "llama_cache_proxy_time_to_first_token_seconds_count") == 1
    resp.close()


def _timings(stream: str) -> dict[str, Any]:
    """The server's ``timings`` of a stream: on its last chunk that has them (the finishing
    one, or the usage chunk after it with ``stream_options.include_usage``)."""
    events = [json.loads(e) for e in stream.split("data: ")[1:] if e.startswith("{")]
    return dict(next(e["timings"] for e in reversed(events) if "timings" in e))


def _cache_n(stream: str) -> int:
    return int(_timings(stream)["cache_n"])


async def test_conversation_id_and_hop_by_hop_headers_not_forwarded(fakes: Any, proxy: Any) -> None:
    fake = await fakes()
    client = await proxy([fake])
    headers = {"X-Conversation-Id": "c1", "Authorization": "Bearer k", "Proxy-Authorization": "x"}
    await client.post("/completion", json={"prompt": "x"}, headers=headers)
    forwarded = {k.lower() for k in fake.received[-1][2]}
    assert "authorization" in forwarded
    assert "x-conversation-id" not in forwarded
    assert "proxy-authorization" not in forwarded


async def test_client_closing_after_done_still_records_the_turn(
    fakes: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake = await fakes()
    fake.linger_s = 0.3  # the client is gone before the proxy ends the chunked body
    client = await proxy([fake])
    first = chat("one two three " * 20, stream=True, prompt_cache_key="k")
    resp = await client.post("/v1/chat/completions", json=first)
    reply = []
    async for line in resp.content:  # OpenClaw closes as soon as it has [DONE]
        if line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: {"):
            reply.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
    resp.close()
    labels = {"endpoint": "/v1/chat/completions", "status": "200"}
    recorded = "llama_cache_proxy_requests_total"
    await until_metric(client, recorded, lambda n: n >= 1, 10.0, **labels)  # the turn's end
    page = await (await client.get("/metrics")).text()
    assert metric(page, recorded, **labels) == 1
    assert "unexpected error" not in caplog.text
    turn = [*first["messages"], {"role": "assistant", "content": "".join(reply)}]
    second = chat("four", messages=[*turn, {"role": "user", "content": "four"}], max_tokens=2)
    answer = await client.post("/v1/chat/completions", json={**second, "prompt_cache_key": "k"})
    assert answer.headers["X-Cache-Route"] == "affinity"


async def test_the_get_routes_answer_head_as_the_server(fakes: Any, proxy: Any) -> None:
    """llama-server answers ``HEAD`` on its GET routes (a 200 with no body); so does the
    proxy, through the backend (it answered 405, later 404)."""
    client = await proxy([await fakes()])
    for path in ("/props", "/slots", "/v1/models"):
        resp = await client.head(path)
        assert resp.status == 200, path
        assert await resp.read() == b""

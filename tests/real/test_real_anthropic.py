"""Anthropic Messages (the ``anthropic`` SDK, Claude-Code-shaped requests) through the proxy to
a real llama-server (SmolLM2-135M): served as a pinned chat completion, the answers match what
llama-server gives for ``/v1/messages`` directly, and a second turn reuses the first's KV."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from anthropic import AsyncAnthropic

from tests.integration.test_anthropic_sdk import FIRST, SYSTEM, TOOLS
from tests.integration.test_anthropic_sdk import SECOND as TOOL_TURN

SAMPLING = {"temperature": 0, "top_k": 1}  # (not parameters of this SDK: sent as extra_body)
GREEDY: dict[str, Any] = {"model": "m", "max_tokens": 24}


def sdk(client: Any) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=str(client.make_url("")), api_key="sk-x", max_retries=0)


async def post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.text()


def blocks(content: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Content blocks without the server's random tool call ids."""
    return [(b["type"], b.get("text"), b.get("name"), b.get("input")) for b in content]


def events(raw: str) -> tuple[list[str], str]:
    names, text = [], []
    for event in raw.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in event.strip().split("\n") if ": " in line)
        if "event" in lines and lines["event"] != "ping":
            names.append(lines["event"])
            delta = json.loads(lines["data"]).get("delta") or {}
            text.append(delta.get("text") or delta.get("partial_json") or "")
    return names, "".join(text)


def total(usage: dict[str, Any]) -> int:
    return int(usage["input_tokens"]) + int(usage.get("cache_read_input_tokens") or 0)


async def test_answers_match_llama_servers_own_messages_endpoint(
    llama_servers: Any, proxy: Any
) -> None:
    server = llama_servers(slots=2)
    client = await proxy([server.url])
    anthropic = sdk(client)
    for messages in (FIRST, TOOL_TURN):
        body = {**GREEDY, "system": SYSTEM, "tools": TOOLS, "messages": messages}
        status, direct = await post(server.url + "/v1/messages", {**body, **SAMPLING})
        assert status == 200, direct
        ref = json.loads(direct)
        via = (await anthropic.messages.create(**body, extra_body=SAMPLING)).model_dump()
        assert blocks(via["content"]) == blocks(ref["content"])
        assert (via["stop_reason"], via["type"], via["role"]) == (
            ref["stop_reason"], "message", "assistant")  # fmt: skip
        assert via["usage"]["output_tokens"] == ref["usage"]["output_tokens"]
        assert total(via["usage"]) == total(ref["usage"])
        streamed = {**body, **SAMPLING, "stream": True}
        status, via_raw = await post(str(client.make_url("/v1/messages")), streamed)
        assert status == 200, via_raw
        assert events(via_raw) == events((await post(server.url + "/v1/messages", streamed))[1])
    counted = await anthropic.messages.count_tokens(model="m", messages=FIRST)
    status, direct = await post(
        server.url + "/v1/messages/count_tokens", {"model": "m", "messages": FIRST}
    )
    assert counted.input_tokens == json.loads(direct)["input_tokens"]
    await anthropic.close()


async def test_a_second_turn_reuses_the_first_turns_kv(llama_servers: Any, proxy: Any) -> None:
    server = llama_servers(slots=2)
    client = await proxy([server.url])
    anthropic = sdk(client)
    first = await anthropic.messages.create(
        **GREEDY,
        extra_body=SAMPLING,
        system=SYSTEM,
        tools=TOOLS,
        messages=FIRST,
    )
    assert first.usage.input_tokens > 100
    async with anthropic.messages.stream(
        **GREEDY,
        extra_body=SAMPLING,
        system=SYSTEM,
        tools=TOOLS,
        messages=TOOL_TURN,
    ) as stream:
        second = await stream.get_final_message()
    cached = second.usage.cache_read_input_tokens
    assert cached is not None
    assert cached > 0.8 * first.usage.input_tokens  # system, tools and the first user turn
    assert second.usage.input_tokens > 0
    await anthropic.close()


def started_usage(raw: str) -> dict[str, Any]:
    """The ``usage`` of a stream's ``message_start`` event."""
    for event in raw.split("\n\n"):
        if event.startswith("event: message_start\n"):
            return dict(json.loads(event.split("data: ", 1)[1])["message"]["usage"])
    raise AssertionError(f"no message_start in {raw!r}")


async def test_a_stream_starts_with_the_prompts_size_and_no_messages_is_served(
    llama_servers: Any, proxy: Any
) -> None:
    server = llama_servers(slots=2)
    client = await proxy([server.url])
    body = {**GREEDY, **SAMPLING, "system": SYSTEM, "messages": FIRST, "stream": True}
    _, direct = await post(server.url + "/v1/messages", body)
    status, via = await post(str(client.make_url("/v1/messages")), body)
    assert status == 200, via
    assert started_usage(via)["input_tokens"] > 0
    assert total(started_usage(via)) == total(started_usage(direct)) > 100
    assert started_usage(via)["output_tokens"] == 0
    empty = {"model": "m", "max_tokens": 5, "messages": []}
    status, direct = await post(server.url + "/v1/messages", empty)
    assert status == 200, direct
    status, via = await post(str(client.make_url("/v1/messages")), empty)
    assert status == 200, via
    assert json.loads(via)["type"] == "message"
    assert total(json.loads(via)["usage"]) == total(json.loads(direct)["usage"])
    text = {**empty, "messages": "hi"}  # not an array: the server converts it to no message
    status, direct = await post(server.url + "/v1/messages", text)
    assert status == 200, direct
    status, via = await post(str(client.make_url("/v1/messages")), text)
    assert status == 200, via
    assert total(json.loads(via)["usage"]) == total(json.loads(direct)["usage"])

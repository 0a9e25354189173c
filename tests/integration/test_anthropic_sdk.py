"""The Anthropic Python SDK as a client of ``/v1/messages`` (fake llama-servers behind it):
served as a pinned chat completion, answered in Anthropic's shapes."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest
from anthropic import AsyncAnthropic

from proxy.core.request.anthropic_request import to_chat
from testbed.fake_llama import render_chat, reply_words, tokenize

SYSTEM: Any = [
    {
        "type": "text",
        "text": "x-anthropic-billing-header: cc_version=2.1; cc_entrypoint=cli; cch=a5145;",
    },
    {
        "type": "text",
        "text": "You are Claude Code. " * 40,
        "cache_control": {"type": "ephemeral"},
    },
]
TOOLS: Any = [
    {
        "name": "Read",
        "description": "Read a file.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]
FIRST: Any = [{"role": "user", "content": [{"type": "text", "text": "Open the README."}]}]
SECOND: Any = [
    *FIRST,
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "R"}}],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "# Title"},
            {"type": "text", "text": "Summarize.", "cache_control": {"type": "ephemeral"}},
        ],
    },
]


async def sdk(proxy: Any, fakes: Any, **settings: Any) -> tuple[AsyncAnthropic, Any]:
    fake = await fakes(n_slots=2)
    client = await proxy([fake], **settings)
    url = str(client.make_url(""))
    return AsyncAnthropic(base_url=url, api_key="sk-test", max_retries=0), fake


def expected(messages: list[dict[str, Any]], count: int = 8) -> str:
    body = {"system": SYSTEM, "tools": TOOLS, "messages": messages}
    return "".join(reply_words(tokenize(render_chat(to_chat(body))), count))


async def test_a_claude_code_turn_is_a_pinned_chat_completion(proxy: Any, fakes: Any) -> None:
    client, fake = await sdk(proxy, fakes)
    args: dict[str, Any] = {"model": "m", "max_tokens": 8, "system": SYSTEM, "tools": TOOLS}
    first = await client.messages.create(messages=FIRST, **args)
    assert first.content[0].type == "text"
    assert first.content[0].text == expected(FIRST)
    assert first.stop_reason == "max_tokens"
    path, sent, _ = fake.received[-1]
    assert path == "/v1/chat/completions"
    assert (sent["id_slot"], sent["cache_prompt"]) == (first_slot(fake), True)
    assert "cch=fffff;" in sent["messages"][0]["content"]
    second = await client.messages.create(messages=SECOND, **args)
    assert second.usage.cache_read_input_tokens is not None
    assert second.usage.cache_read_input_tokens > 100  # the first turn's KV, reused
    assert second.usage.input_tokens > 0
    assert fake.received[-1][1]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "toolu_1",
        "content": "# Title",
    }
    await client.close()


def first_slot(fake: Any) -> int:
    return int(fake.received[0][1]["id_slot"])


async def test_a_streamed_turn_reads_as_anthropic_events(proxy: Any, fakes: Any) -> None:
    client, fake = await sdk(proxy, fakes)
    names, started = [], []
    async with client.messages.stream(
        model="m",
        max_tokens=8,
        system=SYSTEM,
        tools=TOOLS,
        messages=FIRST,
    ) as stream:
        async for event in stream:
            names.append(event.type)
            if event.type == "message_start":
                started.append(event.message.usage)
        message = await stream.get_final_message()
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    assert message.content[0].type == "text"
    assert message.content[0].text == expected(FIRST)
    assert message.usage.output_tokens == 8
    assert message.usage.input_tokens > 100
    assert started[0].input_tokens == message.usage.input_tokens  # known at the first token
    assert fake.received[-1][1]["stream"] is True
    again = await client.messages.create(
        model="m",
        max_tokens=8,
        system=SYSTEM,
        tools=TOOLS,
        messages=FIRST,
    )
    assert again.usage.cache_read_input_tokens == message.usage.input_tokens - 1
    await client.close()


async def test_no_messages_is_answered_as_the_server_answers_it(proxy: Any, fakes: Any) -> None:
    client, fake = await sdk(proxy, fakes)
    message = await client.messages.create(model="m", max_tokens=5, messages=[])
    assert message.type == "message"
    assert fake.received[-1][1]["messages"] == []
    await client.close()


async def test_errors_take_anthropics_shape(proxy: Any, fakes: Any) -> None:
    client, _ = await sdk(proxy, fakes)
    wrong: Any = [{"role": "user", "content": [3]}]  # a content block that is a number
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model="m", max_tokens=8, messages=wrong)
    body: Any = bad.value.body
    assert body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": body["error"]["message"]},
    }
    assert "messages.content" in body["error"]["message"]
    await client.close()

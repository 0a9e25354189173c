"""The official OpenAI Python SDK as a client of the proxy (fake llama-servers behind it)."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

from testbed.fake_llama import render_chat, reply_words, tokenize

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
MESSAGES: Any = [
    {"role": "system", "content": "You are a coding agent. " * 30},
    {"role": "user", "content": "Open the README."},
]


async def sdk(proxy: Any, fakes: Any) -> AsyncOpenAI:
    fake = await fakes(n_slots=2)
    client = await proxy([fake])
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="sk-test", max_retries=0)


def expected(**body: Any) -> str:
    return "".join(reply_words(tokenize(render_chat(body)), 8))


async def test_chat_with_and_without_streaming(proxy: Any, fakes: Any) -> None:
    openai = await sdk(proxy, fakes)
    done = await openai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8)
    assert done.choices[0].message.content == expected(messages=MESSAGES)
    assert done.usage is not None
    assert done.usage.prompt_tokens > 100
    stream = await openai.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(parts) == expected(messages=MESSAGES)
    assert usage is not None
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # same prompt
    await openai.close()


async def test_tools_are_part_of_the_cached_prefix(proxy: Any, fakes: Any) -> None:
    openai = await sdk(proxy, fakes)
    first = await openai.chat.completions.create(
        model="m",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=8,
    )
    assert first.choices[0].message.content == expected(messages=MESSAGES, tools=TOOLS)
    again = await openai.chat.completions.with_raw_response.create(
        model="m",
        messages=[*MESSAGES, {"role": "user", "content": "And the tests."}],
        tools=TOOLS,
        max_tokens=8,
    )
    assert again.headers["X-Cache-Route"] == "prefix"
    parsed = again.parse()
    assert parsed.usage is not None
    assert parsed.usage.prompt_tokens_details is not None
    assert (parsed.usage.prompt_tokens_details.cached_tokens or 0) > 100
    await openai.close()


async def test_prompt_cache_key_drives_affinity(proxy: Any, fakes: Any) -> None:
    openai = await sdk(proxy, fakes)
    routes = []
    for turn in range(3):
        messages = [*MESSAGES, {"role": "user", "content": f"turn {turn}"}]
        raw = await openai.chat.completions.with_raw_response.create(
            model="m",
            messages=messages,
            max_tokens=8,
            prompt_cache_key="session-42",
        )
        routes.append((raw.headers["X-Cache-Route"], raw.headers["X-Cache-Slot"]))
    assert [r for r, _ in routes[1:]] == ["affinity", "affinity"]
    assert len({slot for _, slot in routes}) == 1
    await openai.close()

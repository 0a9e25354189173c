"""Anthropic Messages <-> chat completion, as llama-server maps them (``core.anthropic_*``)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.request.anthropic_reply import StreamReply, error_body, reply_body
from proxy.core.request.anthropic_request import chat_body, normalize_billing_header, to_chat
from proxy.errors import InvalidRequest
from proxy.http.intake import parse_for
from proxy.upstream import ROUTES

KEYS = [
    "messages",
    "system",
    "role",
    "content",
    "type",
    "text",
    "tools",
    "tool_choice",
    "source",
    "input",
    "metadata",
    "user_id",
    "thinking",
    "choices",
    "delta",
    "message",
    "tool_calls",
    "function",
    "arguments",
    "index",
    "timings",
    "usage",
    "error",
]
BILLING = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;"


def test_a_claude_code_turn_becomes_the_chat_the_server_would_render() -> None:
    body = {
        "model": "claude",
        "max_tokens": 64,
        "system": [
            {"type": "text", "text": BILLING + "You are Claude Code."},
            {"type": "text", "text": " Be brief.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "look", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "ls", "input": {"path": "."}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "README.md"},
                    {"type": "text", "text": "and?"},
                ],
            },
        ],
        "tools": [{"name": "ls", "description": "list", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
        "stop_sequences": ["END"],
        "metadata": {"user_id": "user_1_session_9"},
        "stream": True,
        "top_k": 5,
    }
    chat = to_chat(body)
    assert chat["messages"] == [
        {
            "role": "system",
            "content": BILLING.replace("a5145", "fffff") + "You are Claude Code. Be brief.",
        },
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "ls", "arguments": '{"path":"."}'},
                }
            ],
            "reasoning_content": "look",
        },
        {"role": "user", "content": [{"type": "text", "text": "and?"}]},
        {"role": "tool", "tool_call_id": "t1", "content": "README.md"},
    ]
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object"}
    assert (chat["tool_choice"], chat["stop"], chat["max_tokens"]) == ("required", ["END"], 64)
    assert (chat["stream"], chat["top_k"], chat["user"]) == (True, 5, "user_1_session_9")
    assert "metadata" not in chat
    assert chat["model"] == "claude"  # (a llama-server in router mode picks a model by it)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "ab"),
        (None, ""),
        (
            [{"type": "image", "source": {"type": "url", "url": "http://x/i.png"}}],
            [{"type": "image_url", "image_url": {"url": "http://x/i.png"}}],
        ),
    ],
    ids=["text-parts-joined", "no-content", "image-kept-as-parts"],
)
def test_tool_results(content: Any, expected: Any) -> None:
    block = {"type": "tool_result", "tool_use_id": "t", "content": content}
    chat = to_chat({"messages": [{"role": "user", "content": [block]}]})
    assert chat["messages"] == [{"role": "tool", "tool_call_id": "t", "content": expected}]
    assert chat["max_tokens"] == 4096


def test_images_and_thinking_settings() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    body = {
        "system": "plain",
        "messages": [{"role": "user", "content": [image]}, {"role": "assistant"}],
        "thinking": {"type": "enabled", "budget_tokens": 100},
    }
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "plain"},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}],
        },
    ]
    assert chat["thinking_budget_tokens"] == 100


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": ["hi"]},
        {"messages": [{"role": "user", "content": [1]}]},
        {"messages": [], "system": 3},
    ],
    ids=[
        "no-messages",
        "message-not-object",
        "block-not-object",
        "system-number",
    ],
)
def test_shapes_the_server_would_choke_on_are_a_400(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        chat_body(json.dumps(body).encode())


def test_only_a_well_formed_billing_stamp_is_rewritten() -> None:
    assert normalize_billing_header("x-anthropic-billing-header: cch=abc") == (
        "x-anthropic-billing-header: cch=abc"
    )
    assert normalize_billing_header("cch=12345;") == "cch=12345;"


CHAT = {
    "id": "chatcmpl-1",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": "ok",
                "reasoning_content": "hmm",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "ls", "arguments": "{"}}
                ],
            },
        }
    ],
    "usage": {"prompt_tokens": 10, "completion_tokens": 3},
    "timings": {"prompt_n": 4, "cache_n": 6, "predicted_n": 3},
}


def test_a_chat_completion_becomes_a_message() -> None:
    message = json.loads(reply_body(200, json.dumps(CHAT).encode())[1])
    assert message == {
        "id": "chatcmpl-1",
        "type": "message",
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "hmm", "signature": ""},
            {"type": "text", "text": "ok"},
            {"type": "tool_use", "id": "c", "name": "ls", "input": {}},
        ],
        "model": "m",
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"cache_read_input_tokens": 6, "input_tokens": 4, "output_tokens": 3},
    }


def test_usage_falls_back_to_the_openai_counts() -> None:
    answer = {
        **CHAT,
        "timings": None,
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 7},
        },
    }
    usage = json.loads(reply_body(200, json.dumps(answer).encode())[1])["usage"]
    assert usage == {"cache_read_input_tokens": 7, "input_tokens": 3, "output_tokens": 2}


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (
            400,
            b'{"error":{"code":400,"message":"bad","type":"invalid_request_error"}}',
            error_body(400, "bad"),
        ),
        (
            503,
            b"Loading",
            {"type": "error", "error": {"type": "overloaded_error", "message": "Loading"}},
        ),
        (500, b"{}", {"type": "error", "error": {"type": "api_error", "message": "{}"}}),
        (504, b"slow", {"type": "error", "error": {"type": "timeout_error", "message": "slow"}}),
        (200, b'{"choices":[]}', error_body(502, "backend answered without a choice")),
    ],
    ids=["server-error", "text-body", "no-message", "timeout", "no-choice"],
)
def test_errors_take_anthropics_shape(status: int, body: bytes, expected: Any) -> None:
    """... with the server's status, or 502 for a 200 that is no chat completion (a 200
    would make an SDK read the error as a message)."""
    told, sent = reply_body(status, body)
    assert json.loads(sent) == expected
    assert told == (502 if status == 200 else status)


def sse(*chunks: Any) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)


def delta(**d: Any) -> dict[str, Any]:
    return {"id": "x", "model": "m", "choices": [{"index": 0, "delta": d, "finish_reason": None}]}


def events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for part in data.decode().split("\n\n"):
        if part:
            name, payload = part.split("\n")
            out.append((name.removeprefix("event: "), json.loads(payload.removeprefix("data: "))))
    return out


def test_a_stream_becomes_anthropics_events() -> None:
    stream = StreamReply()
    first = stream.lines(
        sse(delta(role="assistant", content=None), delta(reasoning_content="r"), delta(content="a"))
        + b"data: {not json\n"
    )
    call = {"index": 0, "id": "c", "type": "function", "function": {"name": "ls", "arguments": ""}}
    more = stream.lines(
        sse(
            delta(tool_calls=[call]),
            delta(tool_calls=[{"index": 0, "function": {"arguments": "{}"}}]),
            {
                "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
                "timings": {"prompt_n": 2, "cache_n": 5, "predicted_n": 4},
            },
        )
    )
    got = events(first + more + stream.end(b"data: [DONE]\n\n"))
    names = [name for name, _ in got]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",  # thinking
        "content_block_start",
        "content_block_delta",  # text
        "content_block_start",
        "content_block_delta",  # tool_use
        "content_block_delta",
        "content_block_stop",
        "content_block_stop",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [e["index"] for n, e in got if n == "content_block_start"] == [0, 1, 2]
    assert got[5][1]["content_block"] == {"type": "tool_use", "id": "c", "name": "ls", "input": {}}
    assert got[7][1]["delta"] == {"type": "signature_delta", "signature": ""}
    assert got[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert got[-2][1]["usage"] == {
        "cache_read_input_tokens": 5,
        "input_tokens": 2,
        "output_tokens": 4,
    }
    assert stream.end(b"") == b""  # ended once


def test_a_stream_starts_with_the_prompts_counts_from_the_first_tokens_chunk() -> None:
    stream = StreamReply()
    assert stream.lines(sse(delta(role="assistant", content=None))) == b""  # says nothing yet
    first = {**delta(content="Hi"), "timings": {"prompt_n": 3, "cache_n": 28, "predicted_n": 1}}
    got = events(stream.lines(sse(first)))
    assert [name for name, _ in got] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
    ]
    usage = got[0][1]["message"]["usage"]
    assert usage == {"cache_read_input_tokens": 28, "input_tokens": 3, "output_tokens": 0}


def test_a_streamed_request_asks_for_the_counts_on_every_token() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert to_chat(body)["timings_per_token"] is True
    assert "timings_per_token" not in to_chat({**body, "stream": False})


def test_empty_messages_are_served_as_the_server_serves_them() -> None:
    """Both render the generation prompt alone (b11434 answers an empty chat 200)."""
    empty = json.dumps({"model": "m", "max_tokens": 5, "messages": []}).encode()
    assert parse_for(ROUTES["/v1/messages"], empty).data["messages"] == []
    # ``messages`` that is not an array converts to none on /v1/messages, as the server's
    text = json.dumps({"model": "m", "max_tokens": 5, "messages": "hi", "system": "s"}).encode()
    assert parse_for(ROUTES["/v1/messages"], text).data["messages"] == [
        {"role": "system", "content": "s"}
    ]
    assert parse_for(ROUTES["/v1/chat/completions"], empty).data["messages"] == []


def test_an_error_event_in_a_stream_is_anthropics() -> None:
    stream = StreamReply()
    got = events(stream.lines(sse(delta(content="a"), {"error": {"message": "boom"}})))
    assert got[-1] == ("error", error_body(500, "boom"))
    assert stream.end(b"") == b""


def test_keep_alive_comments_become_pings() -> None:
    assert events(StreamReply().lines(b":\n\n")) == [("ping", {"type": "ping"})]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), JSON, max_size=6))
def test_any_body_is_converted_or_refused_with_a_400(body: dict[str, Any]) -> None:
    with contextlib.suppress(InvalidRequest):
        to_chat(body)
    answer = {"choices": [body], "id": "x"}
    status, sent = reply_body(200, json.dumps(answer).encode())
    assert (status, json.loads(sent)["type"]) in ((200, "message"), (502, "error"))
    stream = StreamReply()
    chunk = b"data: " + json.dumps(answer).encode() + b"\n"
    told = stream.lines(chunk) + stream.end(b"")
    assert told.startswith(b"event: message_start\n")
    assert told.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')


def test_the_model_asked_for_is_passed_on() -> None:
    """A llama-server in router mode picks the model a request names."""
    body = {"model": "qwen-7b", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    assert to_chat(body)["model"] == "qwen-7b"
    assert "model" not in to_chat({k: v for k, v in body.items() if k != "model"})

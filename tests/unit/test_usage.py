from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.core.prompt.usage import SseScanner, Usage, read_body, usage_from_object


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        pytest.param({"timings": {"prompt_n": 3, "cache_n": 97}}, Usage(100, 97), id="timings"),
        pytest.param(
            {"timings": {"prompt_n": 1, "cache_n": 9}, "tokens_cached": 14},
            Usage(10, 9, 14),
            id="completion-final",
        ),
        pytest.param(
            {"usage": {"prompt_tokens": 50, "prompt_tokens_details": {"cached_tokens": 40}}},
            Usage(50, 40),
            id="openai-usage",
        ),
        pytest.param(
            {"usage": {"input_tokens": 10, "cache_read_input_tokens": 30}},
            Usage(40, 30),
            id="anthropic",
        ),
        pytest.param(
            {
                "response": {
                    "usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}}
                }
            },
            Usage(9, 4),
            id="responses-completed",
        ),
        pytest.param({"choices": []}, None, id="none"),
        pytest.param({"timings": {"prompt_n": "x", "cache_n": 1}}, None, id="bad-types"),
        pytest.param([1, 2], None, id="not-object"),
    ],
)
def test_usage_from_object(obj: object, expected: Usage | None) -> None:
    assert usage_from_object(obj) == expected


def test_read_body_tolerates_non_json() -> None:
    usage, reply = read_body(b"<html>")
    assert usage is None
    assert reply.content == ""


def test_reply_from_chat_message_with_tool_calls() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    body = {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [call]}}]}
    _, reply = read_body(json.dumps(body).encode())
    assert reply.tool_calls == [call]
    assert reply.content == ""


def test_streamed_tool_call_fragments_are_assembled() -> None:
    chunks = [
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "ls", "arguments": ""},
                            }
                        ]
                    }
                }
            ]
        },
        {
            "choices": [
                {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"p":'}}]}}
            ]
        },
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"."}'}}]}}]},
    ]
    scanner = SseScanner()
    for chunk in chunks:
        scanner.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    call = scanner.reply.tool_calls[0]
    assert call["id"] == "c1"
    assert call["function"] == {"name": "ls", "arguments": '{"p":"."}'}


def test_sse_scanner_across_arbitrary_chunk_boundaries() -> None:
    events = [
        {"choices": [{"delta": {"content": "hi"}}]},
        {"choices": [{"delta": {}}], "timings": {"prompt_n": 2, "cache_n": 8}},
    ]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events)
    stream += b"data: [DONE]\n\n"
    for size in (1, 3, 7, len(stream)):
        scanner = SseScanner()
        ready = b"".join(scanner.feed(stream[i : i + size]) for i in range(0, len(stream), size))
        assert scanner.done
        assert ready == stream[: stream.index(b"data: [DONE]")]  # the end event is held
        assert scanner.close() == b"data: [DONE]\n\n"
        assert scanner.close() == b""  # given back once
        assert scanner.usage == Usage(10, 8)
        assert scanner.events == 3
        assert scanner.reply.content == "hi"


@pytest.mark.parametrize(
    ("partial", "last"),
    [
        pytest.param(
            {"choices": [{"delta": {"content": "a"}, "finish_reason": None}]},
            {"choices": [{"delta": {}, "finish_reason": "length"}]},
            id="chat",
        ),
        pytest.param(
            {"content": "a", "stop": False}, {"content": "", "stop": True}, id="completion"
        ),
    ],
)
def test_per_token_timings_count_only_on_the_last_chunk(
    partial: dict[str, Any], last: dict[str, Any]
) -> None:
    scanner = SseScanner()
    for n in (1, 2):
        chunk = {**partial, "timings": {"prompt_n": 3, "cache_n": 7, "predicted_n": n}}
        scanner.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        assert scanner.usage is None  # the stream's end is when its usage is first read
    chunk = {**last, "timings": {"prompt_n": 3, "cache_n": 7, "predicted_n": 2}}
    scanner.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    assert scanner.usage == Usage(10, 7, completion_tokens=2)


def test_sse_scanner_forwards_whole_lines_and_gives_back_a_last_unterminated_one() -> None:
    scanner = SseScanner()
    assert scanner.feed(b'data: {"content": "a"}\n\ndata: {"con') == b'data: {"content": "a"}\n\n'
    assert scanner.feed(b'tent": "b", "stop": true}') == b""
    assert not scanner.done
    assert scanner.close() == b'data: {"content": "b", "stop": true}'
    assert scanner.reply.content == "ab"
    assert scanner.events == 2

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.core.prompt.usage import SseScanner, Usage, read_body, usage_from_object
from proxy.core.request.anthropic_reply import StreamReply, reply_body


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


# The fields the readers look into, and values of every JSON type for them.
FIELDS = ["choices", "delta", "message", "tool_calls", "index", "function", "name", "id"]
FIELDS += ["arguments", "type", "content", "text", "timings", "usage", "prompt_n", "cache_n"]
FIELDS += ["prompt_tokens", "prompt_tokens_details", "cached_tokens", "input_tokens"]
FIELDS += ["input_tokens_details", "cache_read_input_tokens", "response", "stop"]
FIELDS += ["finish_reason", "predicted_n", "prompt_ms", "tokens_cached", "error"]
ANSWER = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(FIELDS), inner),
    max_leaves=16,
)


def _calls(calls: Any) -> list[Any]:
    return [{"choices": [{"delta": {"tool_calls": calls}}]}]


@settings(max_examples=400, deadline=None)
@given(st.lists(ANSWER, min_size=1, max_size=3))
@example(_calls([{"index": "a", "function": {"name": "f"}}]))
@example(_calls([{"index": None}]))
@example(_calls([{"index": 0, "function": "f"}]))
@example(_calls(5))
@example([{"choices": [{"message": {"tool_calls": [{"function": {"name": 3}}]}}]}])
@example([{"usage": {"prompt_tokens": 3, "prompt_tokens_details": ["x"]}}])
@example([{"usage": {"input_tokens": 3, "input_tokens_details": 7}}])
def test_no_answer_however_malformed_makes_a_reader_raise(answers: list[Any]) -> None:
    """A tool call's ``index`` as a string, ``function`` as a string, details as a list:
    read as absent. (They raised mid-stream, and the proxy wrote a second status line into
    the chunked body.)"""
    for answer in answers:
        read_body(json.dumps(answer).encode())
        usage_from_object(answer)
    scanner, stream = SseScanner(), StreamReply()
    for answer in answers:
        stream.lines(scanner.feed(b"data: " + json.dumps(answer).encode() + b"\n\n"))
    stream.end(scanner.close())
    reply_body(200, json.dumps(answers[0]).encode())


def test_a_batch_answer_counts_every_task() -> None:
    """llama-server answers a batch ``prompt`` with a list, one object per task."""
    answer = [
        {"content": "a", "timings": {"prompt_n": 3, "cache_n": 1, "predicted_n": 2}},
        {"content": "b", "timings": {"prompt_n": 4, "cache_n": 5, "predicted_n": 2}},
    ]
    usage, _ = read_body(json.dumps(answer).encode())
    assert usage == Usage(13, 6, None, 4, None)


@pytest.mark.parametrize(
    "finals",
    [
        pytest.param(
            [
                {"index": 1, "stop": True, "timings": {"prompt_n": 4, "cache_n": 0}},
                {"index": 0, "stop": True, "timings": {"prompt_n": 2, "cache_n": 3}},
            ],
            id="completion-batch",
        ),
        pytest.param(
            [
                {
                    "choices": [{"index": i, "finish_reason": "length", "text": ""}],
                    "usage": {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": c}},
                }
                for i, n, c in ((1, 4, 0), (0, 5, 3))
            ],
            id="v1-completions-batch",
        ),
        pytest.param(
            [
                {
                    "choices": [{"index": i, "finish_reason": "length", "delta": {}}],
                    "timings": {"prompt_n": p, "cache_n": c},
                }
                for i, p, c in ((0, 4, 0), (1, 2, 3))
            ],
            id="chat-n-2",
        ),
        pytest.param(
            [
                {
                    "choices": [],
                    "usage": {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": c}},
                    "timings": {"prompt_n": n - c, "cache_n": c},
                }
                for n, c in ((4, 0), (5, 3))
            ],
            id="chat-n-2-include-usage",
        ),
    ],
)
def test_a_streamed_batch_counts_every_tasks_final_chunk(finals: list[dict[str, Any]]) -> None:
    """Each task of a streamed batch (or each of ``n`` choices) ends with its own final
    chunk, as the server sends them (their shapes as b11434 streams them)."""
    scanner = SseScanner()
    for number, final in enumerate(finals, 1):
        scanner.feed(b"data: " + json.dumps(final).encode() + b"\n\n")
        assert scanner.finals == number
    assert scanner.usage is not None
    assert (scanner.usage.prompt_tokens, scanner.usage.cached_tokens) == (9, 3)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=12))
def test_a_stream_read_in_any_pieces_reads_as_read_whole(body: bytes, cuts: list[int]) -> None:
    """Lines held across reads (kept in pieces until their end arrives) come out as whole."""
    stream = body + b'\ndata: {"content": "' + b"x" * 200 + b'", "stop": true}\n\ndata: [DONE]\n\n'
    whole = SseScanner()
    expected = whole.feed(stream) + whole.close()
    pieces, at = SseScanner(), 0
    out = b""
    for cut in [*sorted({min(c, len(stream)) for c in cuts}), len(stream)]:
        out += pieces.feed(stream[at:cut])
        at = cut
    assert out + pieces.close() == expected == stream
    assert (pieces.usage, pieces.reply.content, pieces.events) == (
        whole.usage,
        whole.reply.content,
        whole.events,
    )

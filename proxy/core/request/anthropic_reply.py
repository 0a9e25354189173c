"""A chat completion's answer as an Anthropic Messages answer, whole or streamed.

The mapping is llama-server's own for ``/v1/messages`` (``to_json_anthropic`` and
``to_json_anthropic_stream``), applied to the chat completion the proxy sent instead
(``core.request.anthropic_request``):

- content blocks in order: ``thinking`` (from ``reasoning_content``, empty ``signature``),
  ``text``, then one ``tool_use`` per tool call (``arguments`` parsed; ``{}`` when not JSON);
- ``stop_reason``: ``tool_calls`` -> ``tool_use``, ``stop`` -> ``end_turn``, otherwise
  ``max_tokens``; ``stop_sequence`` is null (a chat completion does not say which word
  stopped it);
- ``usage``: ``input_tokens`` are the prompt tokens the server computed,
  ``cache_read_input_tokens`` those it reused from the slot's KV (``cache_n``),
  ``output_tokens`` the generated ones.

Streams: ``message_start`` at the first chunk that carries the prompt's counts or a delta,
then per delta a ``content_block_start`` when a block opens and its ``thinking_delta``,
``text_delta`` or ``input_json_delta``; at the end event the blocks close (a thinking block
after a ``signature_delta``), then ``message_delta`` and ``message_stop``; the server's
keep-alive comments become ``ping`` events. The stream was asked for ``timings_per_token``,
so the first token's chunk carries the counts and ``message_start`` reports the prompt's
``input_tokens`` and ``cache_read_input_tokens`` as the server's own does (``output_tokens``
0); the role-only chunk before it says nothing yet. ``message_delta`` carries the whole
``usage`` of the last chunk.

Errors take Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``, the type
chosen by HTTP status; in a stream, as an ``error`` event.
"""

from __future__ import annotations

import json
from typing import Any

_STOP = {"tool_calls": "tool_use", "stop": "end_turn"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",  # (the backend went silent past timeouts.read_seconds)
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_message(answer: Any) -> str:
    """The message of a llama-server (OpenAI-shaped) error body, or the body as text."""
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    return answer if isinstance(answer, str) else json.dumps(answer)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def reply_body(status: int, body: bytes) -> tuple[int, bytes]:
    """The client's status and body for a chat completion's non-streamed answer (or error): a
    200 that is not a chat completion is the backend's fault, a 502."""
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):
        answer = body.decode("utf-8", "replace")
    if status != 200:
        return status, _dumps(error_body(status, error_message(answer)))
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return 502, _dumps(error_body(502, "backend answered without a choice"))
    message = _dict(choices[0].get("message"))
    return status, _dumps(
        {
            "id": answer.get("id", ""),
            "type": "message",
            "role": "assistant",
            "content": _blocks(message),
            "model": answer.get("model", ""),
            "stop_reason": _STOP.get(str(choices[0].get("finish_reason")), "max_tokens"),
            "stop_sequence": None,
            "usage": _usage(answer),
        }
    )


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append(
            {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
        )
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in _dicts(message.get("tool_calls")):
        function = _dict(call.get("function"))
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id", ""),
                "name": function.get("name", ""),
                "input": _input(function.get("arguments", "")),
            }
        )
    return blocks


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _input(arguments: Any) -> Any:
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return {}


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _usage(answer: dict[str, Any]) -> dict[str, int]:
    """From ``timings`` (as the server counts for ``/v1/messages``), else from ``usage``."""
    timings, usage = answer.get("timings"), answer.get("usage")
    if isinstance(timings, dict) and "cache_n" in timings:
        processed, cached = _count(timings.get("prompt_n")), _count(timings.get("cache_n"))
        output = _count(timings.get("predicted_n"))
    elif isinstance(usage, dict):
        details = usage.get("prompt_tokens_details") or {}
        cached = _count(details.get("cached_tokens") if isinstance(details, dict) else 0)
        processed = _count(usage.get("prompt_tokens")) - cached
        output = _count(usage.get("completion_tokens"))
    else:
        processed = cached = output = 0
    return {"cache_read_input_tokens": cached, "input_tokens": processed, "output_tokens": output}


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _dumps(data) + b"\n\n"


def sse_error(status: int, message: str) -> bytes:
    return sse_event("error", error_body(status, message))


class StreamReply:
    """Turns a chat completion's SSE lines into Anthropic's events, as they arrive."""

    def __init__(self) -> None:
        self.started = False
        self.ended = False
        self._thinking = False  # a thinking block was opened (it is block 0)
        self._text: int | None = None  # the text block's index, once opened
        self._tools: dict[int, int] = {}  # tool call index -> block index
        self._stop = "max_tokens"
        self._usage: dict[str, int] = _usage({})
        self._first: dict[str, Any] | None = None  # the first chunk (it names id and model)

    def lines(self, data: bytes) -> bytes:
        """Events for complete SSE lines (``SseScanner``'s ready bytes)."""
        out = bytearray()
        for line in data.split(b"\n"):
            if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                out += self._chunk(line[6:])
            elif line.startswith(b":"):  # the server's keep-alive while it computes the prompt
                out += sse_event("ping", {"type": "ping"})
        return bytes(out)

    def end(self, tail: bytes) -> bytes:
        """The held end of the stream: its lines, then the events that close the message."""
        out = self.lines(tail)
        if self.ended:
            return out
        if self._first is None:  # not one chunk: no message to tell, and a client waits for one
            self.ended = True
            return out + sse_error(502, "backend stream ended without a reply")
        if not self.started:  # no chunk said anything: the message is still told
            out += self._start(self._first)
        self.ended = True
        events = [*self._closes()]
        delta = {"stop_reason": self._stop, "stop_sequence": None}
        events.append(
            sse_event(
                "message_delta", {"type": "message_delta", "delta": delta, "usage": self._usage}
            )
        )
        events.append(sse_event("message_stop", {"type": "message_stop"}))
        return out + b"".join(events)

    def _chunk(self, payload: bytes) -> bytes:
        try:
            chunk = json.loads(payload)
        except (ValueError, RecursionError):
            return b""
        if not isinstance(chunk, dict):
            return b""
        if "error" in chunk:
            self.ended = True
            return sse_error(500, error_message(chunk))
        if self._first is None:
            self._first = chunk
        counts = isinstance(chunk.get("timings"), dict) or isinstance(chunk.get("usage"), dict)
        if counts:
            self._usage = _usage(chunk)
        out, reason = b"", None
        choices = chunk.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            reason = choices[0].get("finish_reason")
            if isinstance(reason, str):
                self._stop = _STOP.get(reason, "max_tokens")
            delta = choices[0].get("delta")
            if isinstance(delta, dict):
                out = self._delta(delta)
        if self.started or not (counts or out or isinstance(reason, str)):
            return out
        return self._start(chunk) + out

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self.started = True
        message = {
            "id": chunk.get("id", ""),
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": chunk.get("model", ""),
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**self._usage, "output_tokens": 0},
        }
        return sse_event("message_start", {"type": "message_start", "message": message})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        out = b""
        reasoning, content = delta.get("reasoning_content"), delta.get("content")
        if isinstance(reasoning, str) and reasoning:
            if not self._thinking:
                self._thinking = True
                out += _block_start(0, {"type": "thinking", "thinking": ""})
            out += _block_delta(0, {"type": "thinking_delta", "thinking": reasoning})
        if isinstance(content, str) and content:
            if self._text is None:
                self._text = int(self._thinking)
                out += _block_start(self._text, {"type": "text", "text": ""})
            out += _block_delta(self._text, {"type": "text_delta", "text": content})
        for call in _dicts(delta.get("tool_calls")):
            out += self._tool(call)
        return out

    def _tool(self, call: dict[str, Any]) -> bytes:
        out, function = b"", _dict(call.get("function"))
        position = _count(call.get("index"))
        if position not in self._tools:
            self._tools[position] = (
                int(self._thinking) + int(self._text is not None) + len(self._tools)
            )
            block = {
                "type": "tool_use",
                "id": call.get("id", ""),
                "name": function.get("name", ""),
                "input": {},
            }
            out += _block_start(self._tools[position], block)
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            delta = {"type": "input_json_delta", "partial_json": arguments}
            out += _block_delta(self._tools[position], delta)
        return out

    def _closes(self) -> list[bytes]:
        events = []
        if self._thinking:
            events.append(_block_delta(0, {"type": "signature_delta", "signature": ""}))
        indexes = ([0] if self._thinking else []) + ([self._text] if self._text is not None else [])
        for index in indexes + sorted(self._tools.values()):
            events.append(
                sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
            )
        return events


def _block_start(index: int, block: dict[str, Any]) -> bytes:
    data = {"type": "content_block_start", "index": index, "content_block": block}
    return sse_event("content_block_start", data)


def _block_delta(index: int, delta: dict[str, Any]) -> bytes:
    data = {"type": "content_block_delta", "index": index, "delta": delta}
    return sse_event("content_block_delta", data)

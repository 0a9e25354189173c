"""Read prompt and cached token counts from what llama-server answers.

llama-server reports, per request, ``timings.prompt_n`` (tokens it had to process) and
``timings.cache_n`` (tokens reused from the slot's KV). The prompt's size is their sum, and
the token-weighted hit rate is ``sum(cache_n) / sum(prompt_n + cache_n)``.

Where it is found:
- non-streamed responses of every endpoint: top-level ``timings``;
- streams: ``timings`` on the last chunk (OpenAI chat/completions and ``/completion``); with
  ``timings_per_token`` every chunk carries them, and a chunk before the last (its
  ``finish_reason`` null, or ``stop`` false) does not count: its ``predicted_n`` is not final,
  and the caller takes the first usage it reads for the end of the stream;
- fallback when ``timings`` is absent: OpenAI ``usage.prompt_tokens`` with
  ``prompt_tokens_details.cached_tokens``, Responses ``input_tokens_details.cached_tokens``,
  Anthropic ``input_tokens`` + ``cache_read_input_tokens``.
``/completion``'s final object also carries ``tokens_cached`` (the slot's KV length after).

A batch (``prompt`` an array: one server task per element) is answered as a list of such
objects, or streamed with one final chunk per task, told apart by ``index``; its usage is the
sum over its tasks (``total``). Anything the server did not send in its documented shape
counts as absent: nothing here raises on an answer, however malformed.

The reply is collected too (``Reply``): the assistant text and tool calls exactly as the
client receives them, because that is what it sends back next turn and what the slot's KV
now holds after the prompt. Streamed tool calls arrive as fragments keyed by ``index`` and
are assembled (``arguments`` concatenated).

``SseScanner`` splits a byte stream into SSE ``data:`` payloads incrementally, and says which
bytes may go on to the client now: every complete line before the stream's end event
(``data: [DONE]``). A partial line waits for its end (a client cannot read half a line anyway),
and the end event with whatever follows it is held (``done``) until the caller has done its
bookkeeping and ``close`` hands it back: a client that stops reading at ``[DONE]`` (OpenAI SDKs,
OpenClaw) and sends its next turn at once then finds the slot already free and recorded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    slot_tokens: int | None = None  # KV length of the slot after the request, when reported
    completion_tokens: int | None = None
    prompt_ms: float | None = None  # time the server spent on the processed prompt tokens

    @property
    def kv_tokens(self) -> int:
        """The slot's KV length after the request: prompt + reply - the last sampled token."""
        if self.slot_tokens is not None:
            return self.slot_tokens
        return self.prompt_tokens + max(0, (self.completion_tokens or 1) - 1)


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def total(usages: list[Usage]) -> Usage | None:
    """The usage of a batch: its tasks' counts summed (no single slot's KV length)."""
    if len(usages) < 2:
        return usages[0] if usages else None
    completions = [u.completion_tokens for u in usages]
    spent = [u.prompt_ms for u in usages]
    return Usage(
        sum(u.prompt_tokens for u in usages),
        sum(u.cached_tokens for u in usages),
        None,
        None if None in completions else sum(c or 0 for c in completions),
        None if None in spent else sum(ms or 0.0 for ms in spent),
    )


def _from_timings(timings: Any, obj: dict[str, Any]) -> Usage | None:
    if not isinstance(timings, dict):
        return None
    processed, cached = _as_int(timings.get("prompt_n")), _as_int(timings.get("cache_n"))
    if processed is None or cached is None:
        return None
    completion = _as_int(timings.get("predicted_n"))
    ms = timings.get("prompt_ms")
    prompt_ms = float(ms) if isinstance(ms, int | float) and not isinstance(ms, bool) else None
    return Usage(
        processed + cached, cached, _as_int(obj.get("tokens_cached")), completion, prompt_ms
    )


def _from_usage(usage: Any) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    prompt = _as_int(usage.get("prompt_tokens"))
    if prompt is not None:
        details = _dict(usage.get("prompt_tokens_details"))
        completion = _as_int(usage.get("completion_tokens"))
        return Usage(prompt, _as_int(details.get("cached_tokens")) or 0, None, completion)
    prompt = _as_int(usage.get("input_tokens"))
    if prompt is None:
        return None
    if "cache_read_input_tokens" in usage:  # Anthropic: input excludes the cached part
        cached = _as_int(usage.get("cache_read_input_tokens")) or 0
        return Usage(prompt + cached, cached)
    details = _dict(usage.get("input_tokens_details"))
    return Usage(prompt, _as_int(details.get("cached_tokens")) or 0)


def usage_from_object(obj: Any) -> Usage | None:
    """Usage from one decoded response object or stream chunk, if it carries any."""
    if not isinstance(obj, dict):
        return None
    found = _from_timings(obj.get("timings"), obj)
    if found is not None:
        return found
    found = _from_usage(obj.get("usage"))
    if found is not None:
        return found
    response = obj.get("response")  # Responses API: response.completed carries usage
    if isinstance(response, dict):
        return _from_usage(response.get("usage"))
    return None


class Reply:
    """The assistant message being relayed: text and tool calls."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}

    @property
    def content(self) -> str:
        return "".join(self.parts)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [self.calls[i] for i in sorted(self.calls)]

    def feed(self, obj: Any) -> None:
        if not isinstance(obj, dict):
            return
        if isinstance(obj.get("content"), str):  # /completion
            self.parts.append(obj["content"])
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        if isinstance(choice.get("text"), str):  # /v1/completions
            self.parts.append(choice["text"])
        message = choice.get("message") or choice.get("delta")
        if isinstance(message, dict):
            self._message(message, whole="message" in choice)

    def _message(self, message: dict[str, Any], *, whole: bool) -> None:
        if isinstance(message.get("content"), str):
            self.parts.append(message["content"])
        calls = message.get("tool_calls")
        for position, call in enumerate(calls if isinstance(calls, list) else []):
            if not isinstance(call, dict):
                continue
            index = None if whole else _as_int(call.get("index"))
            self._call(position if index is None else index, call)

    def _call(self, index: int, call: dict[str, Any]) -> None:
        merged = self.calls.setdefault(
            index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        for field in ("id", "type"):
            if isinstance(call.get(field), str) and call[field]:
                merged[field] = call[field]
        function = _dict(call.get("function"))
        if isinstance(function.get("name"), str) and function["name"]:
            merged["function"]["name"] = function["name"]
        if isinstance(function.get("arguments"), str):
            merged["function"]["arguments"] += function["arguments"]


def read_body(body: bytes) -> tuple[Usage | None, Reply]:
    """Usage and reply of a non-streamed answer (a batch's: its tasks' usage summed)."""
    reply = Reply()
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None, reply
    if isinstance(obj, list):  # a batch: one object per task
        return total([u for u in map(usage_from_object, obj) if u is not None]), reply
    reply.feed(obj)
    return usage_from_object(obj), reply


class SseScanner:
    """Incremental SSE reader: the last usage seen, the reply assembled from chunks, and the
    bytes to forward (``feed``'s result; ``close`` returns the rest)."""

    def __init__(self) -> None:
        self._pending = b""  # the start of a line whose end has not arrived
        self._parts: list[bytes] = []  # chunks after it without a line end (joined once)
        self._held = b""
        self.done = False  # the end event was seen: it and what follows are held
        self.usage: Usage | None = None  # summed over the tasks seen to finish (``finals``)
        self.reply = Reply()
        self.events = 0
        self._finals: dict[int, Usage] = {}  # task index -> its final usage

    @property
    def finals(self) -> int:
        """Tasks whose final chunk (their usage) has been read."""
        return len(self._finals)

    def feed(self, chunk: bytes) -> bytes:
        """Read ``chunk``; return the complete lines before the end event (they may go on now)."""
        if self.done:
            self._held += chunk
            return b""
        if b"\n" not in chunk:  # a line still under way: kept in pieces, joined once it ends
            self._parts.append(chunk)
            return b""
        if self._parts:
            chunk, self._parts = b"".join([*self._parts, chunk]), []
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        for i, line in enumerate(lines):
            if self._line(line.rstrip(b"\r")):
                self.done = True
                self._held = b"".join(rest + b"\n" for rest in lines[i:]) + self._pending
                self._pending = b""
                return b"".join(ready + b"\n" for ready in lines[:i])
        return b"".join(line + b"\n" for line in lines)

    @property
    def ended(self) -> bool:
        """The end event is whole: its line and the blank line after it have arrived (a
        client that follows the SSE rules dispatches it only then)."""
        return self.done and (b"\n\n" in self._held or b"\n\r\n" in self._held)

    def close(self) -> bytes:
        """End of the stream: read a last unterminated line; return every byte still held."""
        self._pending, self._parts = b"".join([self._pending, *self._parts]), []
        tail, self._held = self._held + self._pending, b""
        if self._pending:
            self._line(self._pending.rstrip(b"\r"))
            self._pending = b""
        return tail

    def _line(self, line: bytes) -> bool:
        """Read one line; true for the end event."""
        if not line.startswith(b"data:"):
            return False
        self.events += 1
        payload = line[5:].strip()
        if not payload.startswith(b"{"):
            return payload == b"[DONE]"
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError):
            return False
        self.reply.feed(obj)
        found = None if _partial(obj) else usage_from_object(obj)
        if found is not None:
            task = _task(obj)
            if task is None:  # (one such chunk per task, in turn: each counts as its own)
                task = -1 - sum(1 for key in self._finals if key < 0)
            self._finals[task] = found
            self.usage = total(list(self._finals.values()))
        return False


def _task(obj: Any) -> int | None:
    """Which task of a batch a chunk is of: ``index`` (``/completion``), else its choice's
    (OpenAI shapes: a batch's prompts and ``n``'s choices are tasks alike); None for a chunk
    of no choice at all (``stream_options.include_usage``: each task's usage comes last in a
    chunk whose ``choices`` is empty, naming no task)."""
    obj = _dict(obj)
    found = _as_int(obj.get("index"))
    choices = obj.get("choices")
    if found is None and isinstance(choices, list):
        if not choices:
            return None
        found = _as_int(_dict(choices[0]).get("index"))
    return found or 0


def _partial(obj: Any) -> bool:
    """A stream chunk before the last one (``/completion``'s ``stop`` false, or choices whose
    ``finish_reason`` is null, as the server sends it until the last)."""
    if not isinstance(obj, dict):
        return False
    if obj.get("stop") is False:
        return True
    choices = obj.get("choices")
    return (
        isinstance(choices, list)
        and any(isinstance(c, dict) for c in choices)
        and all(isinstance(c, dict) and c.get("finish_reason", "") is None for c in choices)
    )

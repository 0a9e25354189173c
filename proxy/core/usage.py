"""Read prompt and cached token counts from what llama-server answers.

llama-server reports, per request, ``timings.prompt_n`` (tokens it had to process) and
``timings.cache_n`` (tokens reused from the slot's KV). The prompt's size is their sum, and
the token-weighted hit rate is ``sum(cache_n) / sum(prompt_n + cache_n)``.

Where it is found:
- non-streamed responses of every endpoint: top-level ``timings``;
- streams: ``timings`` on the last chunk (OpenAI chat/completions and ``/completion``);
- fallback when ``timings`` is absent: OpenAI ``usage.prompt_tokens`` with
  ``prompt_tokens_details.cached_tokens``, Responses ``input_tokens_details.cached_tokens``,
  Anthropic ``input_tokens`` + ``cache_read_input_tokens``.
``/completion``'s final object also carries ``tokens_cached`` (the slot's KV length after).

``SseScanner`` splits a byte stream into SSE ``data:`` payloads incrementally and decodes only
those that can carry usage, so relaying stays cheap.
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


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _from_timings(timings: Any, obj: dict[str, Any]) -> Usage | None:
    if not isinstance(timings, dict):
        return None
    processed, cached = _as_int(timings.get("prompt_n")), _as_int(timings.get("cache_n"))
    if processed is None or cached is None:
        return None
    return Usage(processed + cached, cached, _as_int(obj.get("tokens_cached")))


def _from_usage(usage: Any) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    prompt = _as_int(usage.get("prompt_tokens"))
    if prompt is not None:
        details = usage.get("prompt_tokens_details") or {}
        return Usage(prompt, _as_int(details.get("cached_tokens")) or 0)
    prompt = _as_int(usage.get("input_tokens"))
    if prompt is None:
        return None
    if "cache_read_input_tokens" in usage:  # Anthropic: input excludes the cached part
        cached = _as_int(usage.get("cache_read_input_tokens")) or 0
        return Usage(prompt + cached, cached)
    details = usage.get("input_tokens_details") or {}
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


def usage_from_body(body: bytes) -> Usage | None:
    try:
        return usage_from_object(json.loads(body))
    except ValueError:
        return None


_MARKERS = (b'"timings"', b'"usage"')


class SseScanner:
    """Incremental SSE reader that keeps the last usage seen in ``data:`` events."""

    def __init__(self) -> None:
        self._pending = b""
        self.usage: Usage | None = None
        self.events = 0

    def feed(self, chunk: bytes) -> None:
        data = self._pending + chunk
        lines = data.split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            self._line(line.rstrip(b"\r"))

    def close(self) -> None:
        if self._pending:
            self._line(self._pending.rstrip(b"\r"))
            self._pending = b""

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        self.events += 1
        payload = line[5:].strip()
        if not any(marker in payload for marker in _MARKERS):
            return
        try:
            found = usage_from_object(json.loads(payload))
        except ValueError:
            return
        if found is not None:
            self.usage = found

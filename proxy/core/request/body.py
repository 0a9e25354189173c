"""Parse and validate a client's JSON body; rewrite the fields the proxy owns.

The proxy is transparent: it checks only the types of the fields it must understand to route
the request, and only on a route where llama-server reads them (``stream``, ``cache_prompt``,
``n``/``n_cmpl``, ``id_slot`` and token limits on a completion; ``messages`` on a chat;
``prompt`` where it is the prompt), and leaves every other field, known or not, to llama-
server: a field a route ignores passes whatever it holds, as it does directly. The bytes are
read as llama-server's JSON parser reads them: a NUL byte ends them (``json_text``).

It owns exactly two fields, ``id_slot`` and ``cache_prompt`` (a client's ``false`` is kept):
``pin_body`` sets them and nothing else, so the forwarded body is the client's body plus
those two keys — minus ``prefix_cache`` (``{"scope": "auto:8", "window": 8}``), the proxy's
own per-request disk policy, which is validated here and never forwarded (it may only narrow
the operator's: ``core.disk.scope.narrowed``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from proxy.core.disk.scope import Scope, parse_scope, with_window
from proxy.errors import InvalidRequest

# A \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or the reverse: a JSON string
# may then hold a lone surrogate, which Python's decoder accepts and UTF-8 cannot encode
# (llama-server answers such a body 400). A pair (an escaped emoji) does not match.
_LONE_ESCAPE = re.compile(  # one literal start (\u), so the scan stays fast
    rb"\\u[dD](?:[89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|[c-fC-F](?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F]))"
)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # a decoded pair is one code point above


# counts the server reads as numbers and refuses otherwise (``id_slot`` it takes as absent)
_COUNTS = ("n", "n_cmpl", "max_tokens", "max_completion_tokens", "n_predict")


@dataclass(frozen=True)
class ParsedBody:
    """A validated request body. ``data`` is the client's JSON object, unchanged."""

    data: dict[str, Any]
    stream: bool
    completions: int
    client_id_slot: int | None
    prefix_cache: Scope | None = None  # per-request disk scope (stripped from ``data``)
    tasks: int = 1  # server tasks the body makes: a batch ``prompt`` makes one per element
    source: bytes | None = None  # the bytes ``data`` was read from, when it holds all of them


def type_error(field: str, expected: str) -> InvalidRequest:
    return InvalidRequest(f"'{field}' must be {expected}", param=field, code="invalid_type")


def json_text(raw: bytes) -> bytes:
    """The bytes llama-server's parser reads: up to a NUL byte, which ends its input (what
    follows is ignored; inside a string the NUL is refused, as the cut string then is)."""
    end = raw.find(b"\0")
    return raw if end < 0 else raw[:end]


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """Bytes -> JSON object, or ``InvalidRequest`` naming what is wrong."""
    data = decode_json(raw)
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    return data


def decode_json(raw: bytes) -> Any:
    """Bytes -> any JSON value, or ``InvalidRequest`` naming what is wrong."""
    raw = json_text(raw)
    if not raw.strip():
        raise InvalidRequest("request body is empty; a JSON object is required", code="empty_body")
    try:
        text = raw.decode("utf-8-sig")  # (a byte order mark first, as llama-server skips it)
    except UnicodeDecodeError:
        raise InvalidRequest("request body is not valid UTF-8", code="invalid_encoding") from None
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:
        raise InvalidRequest(
            f"request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if _LONE_ESCAPE.search(raw) and _holds_lone_surrogate(data):
        raise InvalidRequest(
            "request body is not valid JSON: a string holds an unpaired UTF-16 surrogate "
            "escape (\\uD800-\\uDFFF not part of a pair)",
            code="invalid_json",
        )
    return data


def _no_constant(name: str) -> Any:
    """``NaN``, ``Infinity``: Python's decoder reads them, JSON (and llama-server) does not;
    re-encoded they would reach the server as something the client did not send."""
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # (1e400: out of a double's range, as llama-server says)
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _holds_lone_surrogate(data: dict[str, Any]) -> bool:
    """Whether any key or string in ``data`` holds a surrogate code point (one the decoder
    did not pair into the character it encodes)."""
    stack: list[Any] = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _check_types(data: dict[str, Any], *, chat: bool, prompt: bool, generates: bool) -> None:
    if generates:
        for field in _COUNTS:  # (the server refuses a count that is not a number: a 400)
            value = data.get(field)
            if value is not None and count(value) is None:
                raise type_error(field, "an integer")
        for field in ("stream", "cache_prompt"):  # (a null is absent, as for the server)
            if data.get(field) is not None and not isinstance(data[field], bool):
                raise type_error(field, "a boolean")
    if chat:  # (an empty array renders the generation prompt alone, as the server does)
        messages = data.get("messages")
        if not isinstance(messages, list):
            raise type_error("messages", "an array")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise type_error(f"messages[{index}]", "an object with a string 'role'")
    text = data.get("prompt")
    if prompt and text is not None and not isinstance(text, str | list | dict):
        raise type_error("prompt", "a string, an array or an object with 'prompt_string'")


def count(value: Any) -> int | None:
    """A count as llama-server reads it: a number's integer part, a boolean as 0 or 1; None
    for anything else (a string, an array, null), for which the server takes its default."""
    if isinstance(value, int | float):  # (bool is an int)
        return int(value)
    return None


def batch_size(prompt: Any) -> int:
    """How many tasks llama-server makes of a ``prompt``: an array holding no integer is a
    batch, one task per element, each given the request's ``id_slot``; anything else (a
    string, token ids, a mixed array of text and ids) is one task."""
    if not isinstance(prompt, list):
        return 1
    if any(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
        return 1
    return max(1, len(prompt))


def parse_body(
    raw: bytes,
    *,
    chat: bool = False,
    prompt: bool = False,
    batches: bool = False,
    generates: bool = True,
) -> ParsedBody:
    """Validate ``raw`` for an endpoint: ``chat``, one that takes ``messages``; ``prompt``,
    one that takes a ``prompt``; ``batches``, one whose ``prompt`` may be a batch;
    ``generates``, one that runs a completion (not an embedding or a rerank: the server
    reads none of a completion's fields there)."""
    data = decode_json_object(raw)
    _check_types(data, chat=chat, prompt=prompt or batches, generates=generates)
    completions = 1
    if generates:  # the server reads n_cmpl, else its alias n, and takes a null as absent
        field = next((k for k in ("n_cmpl", "n") if count(data.get(k)) is not None), "n")
        given = count(data.get(field))
        if given is not None and given < 1:
            raise InvalidRequest(f"'{field}' must be at least 1", param=field, code="invalid_value")
        completions = given or 1
    stripped = "prefix_cache" in data  # (the proxy's own field: not forwarded)
    return ParsedBody(
        data=data,
        stream=generates and bool(data.get("stream") or False),
        completions=completions,
        client_id_slot=count(data.get("id_slot")) if generates else None,
        prefix_cache=_prefix_cache(data.pop("prefix_cache", None)),
        tasks=batch_size(data.get("prompt")) if batches else 1,
        source=None if stripped else json_text(raw),
    )


def _prefix_cache(value: Any) -> Scope | None:
    """``{"scope": ..., "window": N}`` -> Scope; either key may be absent."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"scope", "window"}:
        raise type_error("prefix_cache", "an object with 'scope' and/or 'window'")
    scope, window = value.get("scope", "auto"), value.get("window")
    if not isinstance(scope, str):
        raise type_error("prefix_cache.scope", "a string")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise type_error("prefix_cache.window", "an integer")
    try:
        parsed = parse_scope(scope)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="prefix_cache.scope", code="invalid_value") from None
    try:
        return with_window(parsed, window)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="prefix_cache.window", code="invalid_value") from None


def raw_prompt(body: dict[str, Any]) -> str | list[Any]:
    """A raw body's prompt as llama-server reads it: a list (token ids, or mixed or nested
    prompts), or text (``/infill`` wraps it in ``input_prefix`` and ``input_suffix``; any
    other shape counts as its text form)."""
    prompt = body.get("prompt")
    if body.get("input_prefix") is not None or body.get("input_suffix") is not None:
        prompt = f"{body.get('input_prefix', '')}{prompt or ''}{body.get('input_suffix', '')}"
    if isinstance(prompt, dict):  # {"prompt_string": ..., "multimodal_data": [...]}
        text = prompt.get("prompt_string")
        media = prompt.get("multimodal_data")
        if isinstance(text, str) and not media:
            return text
        return json.dumps(prompt, sort_keys=True)  # media: reuse only of the very same object
    return prompt if isinstance(prompt, str | list) else str(prompt or "")


def is_chat(body: dict[str, Any]) -> bool:
    """A chat body (``messages``, or a Responses ``input``): one segment per message."""
    return "messages" in body or "input" in body


def pin_body(
    data: dict[str, Any], slot: int | None, reuse: bool = True, source: bytes | None = None
) -> bytes:
    """The forwarded body: the client's, with ``id_slot`` and ``cache_prompt`` set by us.

    ``slot=None`` (the server picks, e.g. ``n>1``) removes any client ``id_slot``;
    ``reuse=False`` (cache isolation) makes the server compute the prompt from scratch, as
    does a client's own ``cache_prompt: false`` (kept: it asks for a run that reuses
    nothing, which reused KV may not reproduce bit for bit). With ``source`` (the bytes
    ``data`` was read from, all of it) and neither field in it, the two are written after the
    client's own bytes, which go as they came (no re-encoding: the number spellings the
    client chose, and a large body's encoding time, are kept).
    """
    if source is not None and "id_slot" not in data and "cache_prompt" not in data:
        end = source.rstrip()
        if end.endswith(b"}"):
            pin = f'"id_slot":{slot},' if slot is not None else ""
            fields = f'{"," if data else ""}{pin}"cache_prompt":{"true" if reuse else "false"}}}'
            return end[:-1] + fields.encode()
    out = dict(data)
    out.pop("id_slot", None)
    if slot is not None:
        out["id_slot"] = slot
    out["cache_prompt"] = reuse and data.get("cache_prompt") is not False
    return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

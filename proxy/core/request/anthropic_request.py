"""An Anthropic Messages request as the chat completion llama-server would make of it.

llama-server serves ``/v1/messages`` by converting the body to a chat completion
(``server_chat_convert_anthropic_to_oai``) but then ignores ``id_slot`` there, so the proxy
does that conversion itself and sends a chat completion, which it can pin. The mapping is the
server's:

- ``system`` (a string, or blocks whose ``text`` blocks are concatenated) becomes the first
  message; a Claude Code billing header's per-request ``cch=`` stamp is overwritten with
  ``fffff`` so that it does not end the cached prefix;
- a message whose ``content`` is a list of blocks becomes one message: ``text`` blocks stay
  content parts (``cache_control`` dropped: it changes nothing in the prompt), ``image``
  blocks (base64 or url) become ``image_url`` parts, ``thinking`` blocks are joined into
  ``reasoning_content``, ``tool_use`` blocks become ``tool_calls`` (``input`` as JSON text);
  each ``tool_result`` block follows it as a ``tool`` message (text parts joined, or kept as
  parts when an image is among them);
- ``tools`` (``input_schema`` as ``parameters``), ``tool_choice`` (``auto``; ``any`` and
  ``tool`` as ``required``), ``stop_sequences`` as ``stop``, ``max_tokens`` (4096 when
  absent), ``temperature``, ``top_p``, ``top_k``, ``stream``, ``chat_template_kwargs``, and
  ``thinking.budget_tokens`` (when enabled) as ``thinking_budget_tokens``.
- ``metadata.user_id`` becomes ``user``, so it can key the session (routing's
  ``cache_key_sources``); llama-server ignores it.
- a streamed request asks for ``timings_per_token``: every token's chunk then carries the
  prompt's counts (``prompt_n``, ``cache_n``), so ``message_start`` can report them as the
  server's own does (``core.request.anthropic_reply``); the client never sees the chunks.

Every other field is dropped, as the server drops it. ``messages`` that is not an array
converts to no message, as the server converts it. Shapes the server would choke on (no
``messages``, a message or block that is not an object) are a 400 here.
"""

from __future__ import annotations

import json
from typing import Any

from proxy.core.request.body import decode_json_object, type_error
from proxy.errors import InvalidRequest

DEFAULT_MAX_TOKENS = 4096
_BILLING = "x-anthropic-billing-header:"
_PASSED = ("model", "temperature", "top_p", "top_k", "stream", "chat_template_kwargs")


def chat_body(raw: bytes) -> bytes:
    """The chat completion body for an Anthropic Messages body."""
    chat = to_chat(decode_json_object(raw))
    return json.dumps(chat, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    if "messages" not in body:
        raise InvalidRequest("'messages' is required", param="messages")
    messages = body["messages"]
    if not isinstance(messages, list):
        messages = []  # (as the server converts it: no message, not an error)
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _system_text(system)})
    for message in messages:
        out.extend(_message(message))
    chat: dict[str, Any] = {"messages": out}
    chat.update(_tools(body))
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    chat["max_tokens"] = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    chat.update({key: body[key] for key in _PASSED if key in body})
    if body.get("stream") is True:
        chat["timings_per_token"] = True
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        chat["thinking_budget_tokens"] = thinking.get("budget_tokens", 10000)
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if isinstance(user, str) and user:
        chat["user"] = user
    return chat


def normalize_billing_header(text: str) -> str:
    """Claude Code's billing header with its per-request ``cch=`` stamp made constant."""
    if not text.startswith(_BILLING):
        return text
    at = text.find("cch=", len(_BILLING))
    if at < 0:
        return text
    start = at + 4
    if start + 5 < len(text) and text[start + 5] == ";":
        return text[:start] + "fffff" + text[start + 5 :]
    return text


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return normalize_billing_header(system)
    if not isinstance(system, list):
        raise type_error("system", "a string or an array of blocks")
    texts = [_text(block) for block in _objects(system, "system") if block.get("type") == "text"]
    return "".join(normalize_billing_header(text) for text in texts)


def _objects(items: list[Any], field: str) -> list[dict[str, Any]]:
    if not all(isinstance(item, dict) for item in items):
        raise type_error(field, "an array of objects")
    return items


def _text(block: dict[str, Any], key: str = "text") -> str:
    value = block.get(key, "")
    return value if isinstance(value, str) else ""


def _message(message: Any) -> list[dict[str, Any]]:
    if not isinstance(message, dict):
        raise type_error("messages", "an array of objects")
    role, content = message.get("role"), message.get("content")
    if "content" not in message:
        return [] if role == "assistant" else [message]
    if not isinstance(content, list):
        return [message]
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for block in _objects(content, "messages.content"):
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _text(block)})
        elif kind == "thinking":
            reasoning += _text(block, "thinking")
        elif kind == "image":
            parts.extend(_image(block))
        elif kind == "tool_use":
            calls.append(_tool_call(block))
        elif kind == "tool_result":
            results.append(_tool_result(block))
    out: list[dict[str, Any]] = []
    if parts or calls or reasoning:
        converted: dict[str, Any] = {"role": role, "content": parts or ""}
        if calls:
            converted["tool_calls"] = calls
        if reasoning:
            converted["reasoning_content"] = reasoning
        out.append(converted)
    return out + results


def _image(block: dict[str, Any]) -> list[dict[str, Any]]:
    source = block.get("source")
    if not isinstance(source, dict):
        return []
    if source.get("type") == "base64":
        media = source.get("media_type", "image/jpeg")
        url = f"data:{media};base64,{source.get('data', '')}"
    elif source.get("type") == "url":
        url = _text(source, "url")
    else:
        return []
    return [{"type": "image_url", "image_url": {"url": url}}]


def _tool_call(block: dict[str, Any]) -> dict[str, Any]:
    arguments = block.get("input", {})
    return {
        "id": _text(block, "id"),
        "type": "function",
        "function": {
            "name": _text(block, "name"),
            "arguments": json.dumps(arguments, ensure_ascii=False, separators=(",", ":")),
        },
    }


def _tool_result(block: dict[str, Any]) -> dict[str, Any]:
    content = block.get("content")
    result: Any = ""
    if isinstance(content, str):
        result = content
    elif isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for item in _objects(content, "tool_result.content"):
            if item.get("type") == "text":
                parts.append({"type": "text", "text": _text(item)})
            elif item.get("type") == "image":
                parts.extend(_image(item) or [{}])
        images = any(part.get("type") != "text" for part in parts)
        parts = [part for part in parts if part]
        result = parts if images else "".join(part["text"] for part in parts)
    return {"role": "tool", "tool_call_id": _text(block, "tool_use_id"), "content": result}


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if isinstance(tools, list):
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": _text(tool, "name"),
                    "description": _text(tool, "description"),
                    "parameters": tool.get("input_schema", {}),
                },
            }
            for tool in _objects(tools, "tools")
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") == "auto":
            out["tool_choice"] = "auto"
        elif choice.get("type") in ("any", "tool"):
            out["tool_choice"] = "required"
    return out

"""The only module that knows llama-server's endpoints and the aiohttp client API.

``ROUTES`` lists every path a client may reach and how it uses slots (see the reference,
llama-server.md §1): completion endpoints honour ``id_slot`` and are pinned; ``/v1/messages``
and embeddings run on a slot the server picks, so they need a whole idle backend (so does a
completion whose ``prompt`` is a batch, an array holding no token id: the server makes a task
of each element and gives each the request's ``id_slot``); tokenizer
and template endpoints and the GET metadata endpoints use no slot. Nothing else (notably
``/slots`` and its save/restore/erase actions) is reachable by clients.

aiohttp client errors are translated here: a failed connect (no byte sent) is
``UpstreamConnectError`` so the caller may retry elsewhere; silence past the read timeout is
``GatewayTimeout``; anything else before the response is ``BadGateway``.

The disk tier's calls (``props``, ``render``, ``tokenize``, ``warm``, ``slot_action``) are
here too: each returns the decoded JSON answer, or raises ``SlotActionFailed`` with the
server's message, so the caller never handles aiohttp errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

import aiohttp

from proxy.config import TimeoutSettings
from proxy.core.fleet import BackendPhase, Probe, SlotProbe
from proxy.errors import BadGateway, GatewayTimeout, ProxyError


class SlotUse(Enum):
    PIN = "pin"  # honours id_slot: pinned to one idle slot
    EXCLUSIVE = "exclusive"  # server picks the slot: needs a whole idle backend
    NONE = "none"  # no slot involved


@dataclass(frozen=True)
class Route:
    method: str
    slot_use: SlotUse
    chat: bool = False  # body carries ``messages``
    batches: bool = False  # a ``prompt`` array may be a batch: one task per element


ROUTES: dict[str, Route] = {
    "/v1/chat/completions": Route("POST", SlotUse.PIN, chat=True),
    "/chat/completions": Route("POST", SlotUse.PIN, chat=True),
    "/v1/completions": Route("POST", SlotUse.PIN, batches=True),
    "/completion": Route("POST", SlotUse.PIN, batches=True),
    "/completions": Route("POST", SlotUse.PIN, batches=True),
    "/v1/responses": Route("POST", SlotUse.PIN),
    "/infill": Route("POST", SlotUse.PIN),
    "/v1/messages": Route("POST", SlotUse.EXCLUSIVE),
    "/v1/embeddings": Route("POST", SlotUse.EXCLUSIVE),
    "/embeddings": Route("POST", SlotUse.EXCLUSIVE),
    "/tokenize": Route("POST", SlotUse.NONE),
    "/detokenize": Route("POST", SlotUse.NONE),
    "/apply-template": Route("POST", SlotUse.NONE),
    "/v1/models": Route("GET", SlotUse.NONE),
    "/models": Route("GET", SlotUse.NONE),
    "/props": Route("GET", SlotUse.NONE),
}


class UpstreamConnectError(BadGateway):
    """The backend refused or could not be reached; nothing was sent."""


class SlotActionFailed(Exception):
    """A disk-tier call (render, tokenize, warm, save, restore) did not succeed."""


class LlamaServerClient:
    """One shared ``ClientSession`` with explicit timeouts from Settings."""

    def __init__(self, session: aiohttp.ClientSession, timeouts: TimeoutSettings) -> None:
        self._session = session
        self._timeouts = timeouts
        self._request_timeout = aiohttp.ClientTimeout(
            total=None, connect=timeouts.connect_seconds, sock_read=timeouts.read_seconds
        )
        self._probe_timeout = aiohttp.ClientTimeout(total=timeouts.probe_seconds)

    @asynccontextmanager
    async def send(
        self,
        base_url: str,
        path: str,
        *,
        method: str,
        body: bytes | None,
        headers: list[tuple[str, str]],
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Open a request; yields the response with its headers read, body not yet."""
        try:
            response = await self._session.request(
                method, base_url + path, data=body, headers=headers, timeout=self._request_timeout
            )
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamConnectError(f"backend unreachable: {exc.os_error}") from None
        except (TimeoutError, aiohttp.ServerTimeoutError):
            raise GatewayTimeout("backend did not answer in time") from None
        except aiohttp.ClientError as exc:
            raise BadGateway(f"backend failed: {type(exc).__name__}") from None
        try:
            yield response
        except BaseException:
            response.close()  # unfinished: drop the connection so the server cancels the task
            raise
        else:
            response.release()

    async def probe(self, base_url: str) -> Probe:
        """``/health`` then ``/slots`` (``/props`` when ``/slots`` is disabled)."""
        try:
            async with self._session.get(
                base_url + "/health", timeout=self._probe_timeout
            ) as health:
                if health.status == 503:
                    return Probe(BackendPhase.LOADING)
                if health.status != 200:
                    return Probe(BackendPhase.DOWN)
            return Probe(BackendPhase.READY, await self._slots(base_url))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return Probe(BackendPhase.DOWN)

    async def count_tokens(self, base_url: str, text: str) -> int | None:
        """Tokens of ``text`` by the backend's own tokenizer (``/tokenize``); None on failure."""
        body = {"content": text, "add_special": False}
        try:
            async with self._session.post(
                base_url + "/tokenize", json=body, timeout=self._probe_timeout
            ) as resp:
                if resp.status != 200:
                    return None
                return len((await resp.json())["tokens"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            return None

    async def _call(self, base_url: str, path: str, body: dict[str, Any] | None) -> Any:
        try:
            if body is None:
                request = self._session.get(base_url + path, timeout=self._request_timeout)
            else:
                request = self._session.post(
                    base_url + path, json=body, timeout=self._request_timeout
                )
            async with request as resp:
                answer = await resp.json(content_type=None)
                if resp.status != 200:
                    error = answer.get("error") if isinstance(answer, dict) else None
                    message = error.get("message") if isinstance(error, dict) else answer
                    raise SlotActionFailed(f"{path}: {resp.status} {message}")
                return answer
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise SlotActionFailed(f"{path}: {type(exc).__name__}") from None

    async def props(self, base_url: str) -> dict[str, Any]:
        answer = await self._call(base_url, "/props", None)
        if not isinstance(answer, dict):
            raise SlotActionFailed("/props: not an object")
        return answer

    async def render(self, base_url: str, body: dict[str, Any], *, generation: bool) -> str:
        """The prompt text the chat template renders for ``body`` (``/apply-template``)."""
        answer = await self._call(
            base_url, "/apply-template", {**body, "add_generation_prompt": generation}
        )
        return str(answer["prompt"])

    async def tokenize(self, base_url: str, text: str) -> list[int]:
        """Token ids exactly as a chat request tokenizes its rendered prompt (with BOS)."""
        answer = await self._call(base_url, "/tokenize", {"content": text, "add_special": True})
        return [int(t) for t in answer["tokens"]]

    async def warm(
        self, base_url: str, tokens: list[int], slot: int, reuse: bool = True
    ) -> dict[str, Any]:
        """Prefill ``tokens`` into ``slot`` and nothing else (``n_predict: 0`` leaves exactly
        the prompt in the KV, reference §7)."""
        body = {"prompt": tokens, "n_predict": 0, "id_slot": slot, "cache_prompt": reuse}
        answer: dict[str, Any] = await self._call(base_url, "/completion", body)
        return answer

    async def slot_action(
        self, base_url: str, slot: int, action: str, filename: str
    ) -> dict[str, Any]:
        """``save`` or ``restore`` a slot to or from ``filename`` in the server's save path."""
        path = f"/slots/{slot}?action={action}"
        answer: dict[str, Any] = await self._call(base_url, path, {"filename": filename})
        return answer

    async def _slots(self, base_url: str) -> tuple[SlotProbe, ...]:
        async with self._session.get(base_url + "/slots", timeout=self._probe_timeout) as resp:
            if resp.status == 200:
                return tuple(_slot_probe(item) for item in await resp.json())
        async with self._session.get(base_url + "/props", timeout=self._probe_timeout) as resp:
            props = await resp.json()
        total = int(props.get("total_slots", 0))
        return tuple(SlotProbe(i, False, 0, -1) for i in range(total))


def _slot_probe(item: dict[str, Any]) -> SlotProbe:
    return SlotProbe(
        id=int(item["id"]),
        processing=bool(item.get("is_processing", False)),
        n_tokens=int(item.get("n_prompt_tokens", 0) or 0),
        task_id=int(item.get("id_task", -1) if item.get("id_task") is not None else -1),
    )


def translate_stream_error(exc: BaseException) -> ProxyError:
    """An error while reading a response body, as the proxy reports it."""
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return GatewayTimeout("backend went silent mid-response")
    return BadGateway(f"backend failed mid-response: {type(exc).__name__}")

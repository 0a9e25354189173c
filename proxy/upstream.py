"""The only module that knows llama-server's endpoints and the aiohttp client API.

``ROUTES`` lists every path a client may reach and how it uses slots (see the reference,
llama-server.md §1): completion endpoints honour ``id_slot`` and are pinned, and so is
``/v1/messages``, sent as a chat completion (``via``: the server ignores ``id_slot`` on it);
embeddings, reranking and decisions run on a slot the server picks, so they need a whole idle
backend (so does a completion whose ``prompt`` is a batch, an array holding no token id: the
server makes a task of each element and gives each the request's ``id_slot``); tokenizer,
template and token-counting endpoints, server tools, the MCP CORS proxy, router mode's model
management (``/models`` and below) and the GET metadata endpoints use no slot. ``REFUSED``:
the routes the proxy refuses itself, and why; any other path is a 404. ``HEALTH`` and
``PUBLIC`` are the paths llama-server checks no API key on: its readiness paths (served by the
proxy) and ``/`` (its web UI, forwarded).

Each backend may have an API key (``BackendSettings.api_key``): the proxy's own calls carry
it, and so does every forwarded request in place of the client's credential
(``core.prompt.headers.with_credential``). A backend whose ``/slots`` and ``/props`` answer 401
(a key the proxy lacks) stays ready, probed by the public ``/health``, as one slot.

Proxied requests go out through ``proxy.upstream_http`` (keep-alive connections and a lean
HTTP/1.1 exchange: the request path's client); the proxy's own calls through an aiohttp
session. Errors are translated here: a failed connect (no byte sent) is
``UpstreamConnectError`` so the caller may retry elsewhere; silence past the read timeout is
``GatewayTimeout``; anything else before the response is ``BadGateway``, and so is a body
that breaks off (``GatewayTimeout`` when it goes silent; a stream's relay reports its own,
as its status line has gone).

The disk tier's calls (``props``, ``render``, ``tokenize``, ``warm``, ``slot_action``) and
the RAM cache's primer (``prime``) are here too: each returns the decoded JSON answer (the
primer nothing), or raises ``SlotActionFailed`` with the server's message, so the caller
never handles aiohttp errors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

import aiohttp

from proxy.config.settings import TimeoutSettings
from proxy.core.prompt.headers import with_credential
from proxy.core.server.fleet import BackendPhase, Probe, SlotProbe
from proxy.core.server.ram_cache import PRIMER
from proxy.errors import BadGateway, GatewayTimeout, ProxyError
from proxy.upstream_http import (
    ConnectFailed,
    ConnectTimeout,
    Pool,
    ReadTimeout,
    Response,
    UpstreamBroken,
)

log = logging.getLogger(__name__)


class _Unread(Exception):
    """A healthy backend's ``/props`` answered an error (``probe``)."""


@dataclass(frozen=True)
class Unread:
    """A probe of a healthy backend that told nothing of its slots, and why (``probe``)."""

    reason: str


class SlotUse(Enum):
    PIN = "pin"  # honours id_slot: pinned to one idle slot
    EXCLUSIVE = "exclusive"  # server picks the slot: needs a whole idle backend
    NONE = "none"  # no slot involved


@dataclass(frozen=True)
class Route:
    methods: tuple[str, ...]
    slot_use: SlotUse
    chat: bool = False  # body carries ``messages``
    prompt: bool = False  # body carries a ``prompt``
    batches: bool = False  # a ``prompt`` array may be a batch: one task per element
    json: bool = True  # body is JSON (checked before it is forwarded; an object if routed)
    via: str | None = None  # sent to this path instead, translated (``core.request.anthropic_*``)

    @property
    def method(self) -> str:
        return self.methods[0]


def _route(method: str, slot_use: SlotUse, **flags: Any) -> Route:
    return Route(tuple(method.split("+")), slot_use, **flags)


_PIN, _EXCLUSIVE, _NONE = SlotUse.PIN, SlotUse.EXCLUSIVE, SlotUse.NONE


ROUTES: dict[str, Route] = {
    "/v1/chat/completions": _route("POST", _PIN, chat=True),
    "/chat/completions": _route("POST", _PIN, chat=True),
    "/v1/completions": _route("POST", _PIN, batches=True),
    "/completion": _route("POST", _PIN, batches=True),
    "/completions": _route("POST", _PIN, batches=True),
    "/v1/responses": _route("POST", _PIN),
    "/responses": _route("POST", _PIN),
    "/infill": _route("POST", _PIN, prompt=True),
    "/v1/messages": Route(("POST",), _PIN, chat=True, via="/v1/chat/completions"),
    "/v1/embeddings": _route("POST", _EXCLUSIVE),
    "/embeddings": _route("POST", _EXCLUSIVE),
    "/embedding": _route("POST", _EXCLUSIVE),
    **{path: _route("POST", _EXCLUSIVE) for path in ("/rerank", "/reranking")},
    **{path: _route("POST", _EXCLUSIVE) for path in ("/v1/rerank", "/v1/reranking")},
    "/v1/systemone": _route("POST", _EXCLUSIVE),
    "/tokenize": _route("POST", _NONE),
    "/detokenize": _route("POST", _NONE),
    "/apply-template": _route("POST", _NONE),
    "/chat/completions/input_tokens": _route("POST", _NONE),
    "/v1/chat/completions/input_tokens": _route("POST", _NONE),
    "/responses/input_tokens": _route("POST", _NONE),
    "/v1/responses/input_tokens": _route("POST", _NONE),
    "/v1/messages/count_tokens": _route("POST", _NONE),
    "/v1/models": _route("GET", _NONE),
    "/models": _route("GET+POST+DELETE", _NONE),  # POST (download), DELETE: router mode
    **{path: _route("POST", _NONE) for path in ("/models/load", "/models/unload")},
    "/models/sse": _route("GET", _NONE),  # router mode's event stream, relayed as it comes
    "/props": _route("GET", _NONE),
    "/slots": _route("GET", _NONE),
    "/lora-adapters": _route("GET", _NONE),
    "/tools": _route("GET+POST", _NONE),
    "/cors-proxy": _route("GET+POST", _NONE, json=False),
}
HEALTH = ("/health", "/v1/health")  # answered by the proxy: is any backend ready
# the Origin of the proxy's own /health probes: a backend that echoes it in its CORS headers
# allows every origin (llama-server's default), which the proxy's own answers then do too
PROBE_ORIGIN = "http://llama-cache-proxy.invalid"
# llama-server checks no API key there (server-http.cpp): its health paths, and ``/`` (the web
# UI's page, served by a backend: the proxy's catch-all)
PUBLIC = frozenset((*HEALTH, "/"))
# llama-server's ``Server`` header, which every answer of the proxy carries too (a client
# sees one server, and not the stack the proxy runs on)
SERVER_SOFTWARE = "llama.cpp"
# llama-server's HTTP parser limits (cpp-httplib), which the proxy's parser keeps too: a request
# line of up to 32,766 bytes (a long query string; aiohttp bounds the target, here as for a
# GET's line), at most 100 header lines (aiohttp's own defaults: 8,190 and 128). A header
# line's 8,190 bytes are aiohttp's default already.
TARGET_MAX_BYTES = 32766 - len("GET  HTTP/1.1")
HEADERS_MAX = 100
_SLOTS_OWNED = (
    "the proxy manages slots itself (pins, saves and restores); a client's slot action "
    "would change a slot's contents under it"
)
_BACKEND_BOUND = (
    "it names a completion or stream running on one backend, and the proxy does not track which"
)
REFUSED: dict[tuple[str, str], str] = {
    ("POST", "/slots/{id_slot}"): _SLOTS_OWNED,
    ("POST", "/props"): "it changes one backend's global properties under the proxy",
    ("POST", "/lora-adapters"): "it changes one backend's global adapter scales for every "
    "client; send a request's own lora field instead",
    ("POST", "/v1/chat/completions/control"): _BACKEND_BOUND,
    ("GET", "/v1/stream"): _BACKEND_BOUND,
    ("DELETE", "/v1/stream"): _BACKEND_BOUND,
    ("POST", "/v1/streams/lookup"): _BACKEND_BOUND,
}


class UpstreamConnectError(BadGateway):
    """The backend refused or could not be reached; nothing was sent."""


class BackendLoading(UpstreamConnectError):
    """The backend answered that it is loading its model (it restarted since it was last
    probed): nothing ran, so the request may go elsewhere, or wait for it."""


def loading_answer(status: int, body: bytes) -> bool:
    """Whether an answer is llama-server's while it loads its model: every path but its page
    answers 503 ``Loading model`` then (its server-state middleware)."""
    if status != 503:
        return False
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError, RecursionError):
        return False
    return isinstance(error, dict) and error.get("message") == "Loading model"


class SlotActionFailed(Exception):
    """A disk-tier call (render, tokenize, warm, save, restore) did not succeed."""


class LlamaServerClient:
    """The request path's connections (``upstream_http.Pool``) and one ``ClientSession`` for
    the proxy's own calls, with explicit timeouts from Settings."""

    def __init__(
        self,
        session: aiohttp.ClientSession | None,
        timeouts: TimeoutSettings,
        keys: Mapping[str, str | None] | None = None,
        on_open: Callable[[str], None] | None = None,
    ) -> None:
        """``on_open(base_url)``: told of each connection the request path opens."""
        self._session = session  # None: opened by ``open`` (and closed by ``close``)
        self._owned = session is None
        self._keys = keys or {}  # base URL -> that backend's API key
        self._timeouts = timeouts
        self._request_timeout = aiohttp.ClientTimeout(
            total=None, connect=timeouts.connect_seconds, sock_read=timeouts.read_seconds
        )
        self._probe_timeout = aiohttp.ClientTimeout(total=timeouts.probe_seconds)
        self._pool = Pool(timeouts.connect_seconds, timeouts.read_seconds, on_open=on_open)
        # base URL -> the CORS headers of its last healthy /health answer to ``PROBE_ORIGIN``
        self.probe_cors: dict[str, dict[str, str]] = {}

    async def open(self) -> None:
        """Open the client's own connection pool (inside the running event loop)."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
            # no cookie jar: a cookie a backend (or a gateway before it) sets is its client's,
            # relayed in the response; a jar would send it with every later client's request
            jar = aiohttp.DummyCookieJar()
            self._session = aiohttp.ClientSession(connector=connector, cookie_jar=jar)

    async def close(self) -> None:
        self._pool.close()
        if self._owned and self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("LlamaServerClient: open() it first")
        return self._session

    @asynccontextmanager
    async def send(
        self,
        base_url: str,
        path: str,
        *,
        method: str,
        body: bytes | None,
        headers: list[tuple[str, str]],
        head_seconds: float | None = None,
    ) -> AsyncIterator[Response]:
        """Open a request; yields the response with its headers read, body not yet.
        ``path`` is as the client sent it, query string included, still percent-encoded;
        ``head_seconds``: the bound on the wait for the headers (default: the read timeout)."""
        headers = with_credential(headers, self._keys.get(base_url))
        try:
            response = await self._pool.request(base_url, path, method, body, headers, head_seconds)
        except ConnectFailed as exc:  # (its address is for the log, not for clients)
            log.warning("backend %s unreachable: %s", base_url, exc)
            raise UpstreamConnectError("backend unreachable") from None
        except ConnectTimeout:  # (nothing was sent either)
            raise UpstreamConnectError("backend unreachable: no connection in time") from None
        except TimeoutError:
            raise GatewayTimeout("backend did not answer in time") from None
        except UpstreamBroken as exc:
            raise BadGateway(f"backend failed: {exc}") from None
        try:
            yield response
        except (UpstreamBroken, ReadTimeout) as exc:  # reading the body (a stream's relay
            response.close()  # reports its own: the status line has gone)
            raise translate_stream_error(exc) from None
        except BaseException:
            response.close()  # unfinished: drop the connection so the server cancels the task
            raise
        else:
            response.release()

    async def probe(self, base_url: str, slots: bool = True) -> Probe | Unread:
        """``/health``, ``/props``, then, if ``slots`` and awake, ``/slots`` (a task: it wakes a
        sleeping server and restarts its idle timer; the others do neither). ``Unread``:
        healthy, but ``/props`` answered an error, or it or ``/slots`` did not answer in time,
        which tells nothing of its slots (the caller keeps what it knows: a backend whose
        ``/props`` is slower than the probe timeout was held down for good)."""
        options = self._short(base_url)
        options["headers"] = {**options["headers"], "Origin": PROBE_ORIGIN}
        try:
            async with self._http.get(base_url + "/health", **options) as up:
                if up.status != 200:
                    return Probe(BackendPhase.LOADING if up.status == 503 else BackendPhase.DOWN)
                self.probe_cors[base_url] = {
                    name.title(): value
                    for name, value in up.headers.items()
                    if name.lower().startswith("access-control-") or name.lower() == "vary"
                }
            try:
                return await self._slots(base_url, slots)
            except TimeoutError:  # healthy, but slow to tell more (a long prefill, a busy host)
                return Unread("/props or /slots did not answer within the probe timeout")
        except _Unread as exc:
            return Unread(str(exc))
        # (TypeError, KeyError, AttributeError: an answer not shaped as llama-server's)
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, KeyError, AttributeError):
            return Probe(BackendPhase.DOWN)

    async def count_tokens(self, base_url: str, text: str) -> int | None:
        """Tokens of ``text`` by the backend's own tokenizer (``/tokenize``); None on failure."""
        body = {"content": text, "add_special": False}
        try:
            async with self._http.post(
                base_url + "/tokenize", json=body, **self._short(base_url)
            ) as resp:
                if resp.status != 200:
                    return None
                return len((await resp.json())["tokens"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            return None

    async def metrics(self, base_url: str) -> tuple[str, str | None] | None:
        """``/metrics`` text and ``Process-Start-Time-Unix``; None unless a 200 (not a 501:
        no ``--metrics``) within the probe timeout."""
        try:
            async with self._http.get(base_url + "/metrics", **self._short(base_url)) as resp:
                start = resp.headers.get("Process-Start-Time-Unix")
                return (await resp.text("utf-8"), start) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    def _short(self, base_url: str) -> dict[str, Any]:
        """The options of the proxy's own short calls: the probe timeout, the API key."""
        return {"timeout": self._probe_timeout, "headers": self._auth(base_url)}

    def _auth(self, base_url: str) -> dict[str, str]:
        """The headers that carry the backend's API key on the proxy's own calls."""
        key = self._keys.get(base_url)
        return {} if key is None else {"Authorization": f"Bearer {key}"}

    async def _call(self, base_url: str, path: str, body: dict[str, Any] | None) -> Any:
        opts: dict[str, Any] = {"timeout": self._request_timeout, "headers": self._auth(base_url)}
        try:
            if body is None:
                request = self._http.get(base_url + path, **opts)
            else:
                request = self._http.post(base_url + path, json=body, **opts)
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
        self, base_url: str, tokens: list[int], slot: int, reuse: bool = True, lora: Any = None
    ) -> dict[str, Any]:
        """Prefill ``tokens`` into ``slot`` and nothing else (``n_predict: 0`` leaves exactly
        the prompt in the KV, reference §7), under the request's LoRA adapters (``lora``, as
        it sent them; None: the server's own)."""
        body = {"prompt": tokens, "n_predict": 0, "id_slot": slot, "cache_prompt": reuse}
        if lora is not None:
            body["lora"] = lora
        answer: dict[str, Any] = await self._call(base_url, "/completion", body)
        return answer

    async def prime(self, base_url: str, slot: int, request: Mapping[str, Any]) -> None:
        """Prefill the primer (``core.server.ram_cache.PRIMER``) into ``slot``: its RAM-cache
        hook parks what the slot holds, and the next request pinned there loads its session.
        Under the ``request``'s LoRA adapters (a change of adapters clears the slot) and for
        its ``model`` (a server in router mode picks the model by it)."""
        body = {"prompt": PRIMER, "n_predict": 0, "id_slot": slot, "cache_prompt": True}
        body.update((k, request[k]) for k in ("lora", "model") if request.get(k) is not None)
        await self._call(base_url, "/completion", body)

    async def slot_action(
        self, base_url: str, slot: int, action: str, filename: str
    ) -> dict[str, Any]:
        """``save`` or ``restore`` a slot to or from ``filename`` in the server's save path."""
        path = f"/slots/{slot}?action={action}"
        answer: dict[str, Any] = await self._call(base_url, path, {"filename": filename})
        return answer

    async def _slots(self, base_url: str, wanted: bool) -> Probe:
        options = self._short(base_url)
        async with self._http.get(base_url + "/props", **options) as resp:
            locked = resp.status == 401  # --api-key and no key here: run it as one slot
            if resp.status != 200 and not locked:  # (its error body counts no slot)
                raise _Unread(f"/props answered {resp.status}")
            props = {} if locked else await resp.json()
        sleeping = bool(props.get("is_sleeping"))
        total = int(props.get("total_slots", locked))
        counted = tuple(SlotProbe(i, False, 0, -1) for i in range(total))
        identity = None if locked else _identity(props)
        if wanted and not sleeping and not locked and props.get("endpoint_slots") is not False:
            async with self._http.get(base_url + "/slots", **options) as resp:
                if resp.status == 200:
                    seen = tuple(map(_slot_probe, await resp.json()))
                    return Probe(BackendPhase.READY, seen, identity=identity)
        return Probe(BackendPhase.READY, counted, False, sleeping, identity)


def _identity(props: dict[str, Any]) -> tuple[str, ...]:
    """What a server runs, by ``/props`` (read while it sleeps too): a server restarted with
    another model, context or build between two probes shows no other sign of it while idle,
    and a snapshot of its old model would be restored into the new one."""
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    fields = (props.get(k) for k in ("model_path", "model_ftype", "total_slots", "build_info"))
    return (*map(str, fields), str(n_ctx))


def _slot_probe(item: dict[str, Any]) -> SlotProbe:
    return SlotProbe(
        id=int(item["id"]),
        processing=bool(item.get("is_processing", False)),
        n_tokens=int(item.get("n_prompt_tokens", 0) or 0),
        task_id=int(item.get("id_task", -1) if item.get("id_task") is not None else -1),
    )


def translate_stream_error(exc: BaseException) -> ProxyError:
    """An error while reading a response body, as the proxy reports it."""
    if isinstance(exc, TimeoutError):
        return GatewayTimeout("backend went silent mid-response")
    return BadGateway(f"backend failed mid-response: {type(exc).__name__}")

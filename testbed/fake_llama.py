"""A deterministic fake llama-server for fast and fleet-scale tests.

It follows the real server's semantics (llama-server b11434, as verified against it by
``tests/real/test_fake_parity.py``), at the level the proxy depends on:

- slots: each holds the tokens of its last prompt plus reply minus the last sampled token;
  a request reuses the longest common prefix (``cache_n``) and always re-evaluates at least
  one token; ``cache_prompt: false`` reuses nothing;
- slot choice without ``id_slot``: the idle, non-empty slot with the best LCP similarity
  above 0.1, else the least recently used idle slot; ``id_slot`` wraps modulo the slot count;
  a busy pinned slot defers the task (and is recorded in ``violations``, since the real
  server can corrupt the running generation in that case);
- ``n`` > slots is a 400; a prompt of ``n_ctx`` tokens or more is a 400;
- a batch ``prompt`` (an array of two or more holding no integer) on the completion
  endpoints is one task per element, every one given the request's ``id_slot``, their
  results in order (OAI: one ``choices`` list), streamed chunks interleaved with an ``index``;
- the host-RAM prompt cache (``--cache-ram``, on by default, with ``--cache-idle-slots``):
  when a task starts, every idle slot's tokens are saved there (an entry that is a prefix of
  another is dropped; not with ``cache_idle_slots=False``, ``--no-cache-idle-slots``); a
  slot chosen by LRU, or pinned while it would lose more than half its tokens
  (``f_keep < 0.5``), first saves its tokens and then scans the entries oldest
  first, taking each that keeps at least a quarter of itself and beats the best so far (from
  the slot's own tokens) in both kept share and similarity; the last taken moves into the
  slot; a pinned *empty* slot skips this (upstream #28139); ``ram_tokens`` bounds it like
  ``--cache-ram`` MiB (bytes per token fixed by the model): an entry larger is not saved,
  and the oldest entries go to make room; with unified KV (``unified``) each idle slot so
  saved is also cleared;
- ``sleep_idle_s`` (``--sleep-idle-seconds``): idle that long since its last task, the server
  sleeps, its context destroyed (every slot's KV and the RAM cache); ``/props`` says
  ``is_sleeping``; every task (``/slots`` too, but not ``/health``, ``/props``, ``/models``
  or ``/metrics``) wakes it and restarts the idle timer;
- ``router`` (started without a model): ``/models`` also takes POST (download) and DELETE,
  ``/models/load`` and ``/models/unload`` answer ``{"success": true}``, and each action is an
  event on the ``GET /models/sse`` stream as it happens;
- ``/v1/messages`` ignores ``id_slot``; ``n_predict: 0`` still samples one token;
- prefill is serialized per server (one compute device: ``prompt_s_per_token`` per processed
  token, one request at a time), decoding runs in parallel across slots;
- an aborted request keeps its slot busy for ``abort_release_s`` (the real server polls the
  socket once a second); with ``disconnect_poll_s`` (the real server's is 1 s) a request
  whose client left while it waited for its answer (not streamed, or before its first
  chunk) is cancelled only once that long has passed with no task result on the server, as
  the real one checks the socket only then (``HTTP_POLLING_SECONDS``): every answer to
  ``/slots`` or ``/metrics``, completion result and stream chunk restarts it;
- ``GET /metrics`` (with ``metrics = True``, ``--metrics``) is llama-server-shaped Prometheus
  text: ``llamacpp:prompt_tokens_total`` (prompt tokens computed) and
  ``llamacpp:requests_processing`` (busy slots), each with ``# HELP`` and ``# TYPE``, and a
  ``Process-Start-Time-Unix`` header; 501 without it, as the real server answers;
- responses carry ``timings`` (``prompt_n``, ``cache_n``, ``prompt_ms`` when prefill takes
  time) like the real ones, streamed
  (the finishing chunk, or with ``stream_options.include_usage`` the usage chunk after it,
  whose ``choices`` is empty; every chunk with ``timings_per_token``) and not;
- slot save/restore (``POST /slots/{id}?action=save|restore``, reference §5): 501 without a
  save directory; filenames with ``/``, ``\\`` or ``..`` are a 400; an action on a busy slot
  waits until it is idle; a file records the slot's tokens and its KV layout (``n_stream`` =
  1 with unified KV, else the slot count, and ``n_ctx``) and a restore into another layout,
  of a missing file, or of more tokens than fit, is a 400 that *wipes the slot*; restores
  are all or nothing and bypass the RAM cache; token-array prompts are used verbatim
  (``/tokenize`` ids map back to words);
- ``memory`` (opt-in, ``testbed.fake_memory``): a sliding-window (``--swa-full`` or not) or
  recurrent/hybrid model's reuse rules: the ``n_swa`` window, context checkpoints (user
  message starts of chat requests, ``4 + n_ubatch`` and 4 tokens before a prompt's end, at
  most ``ctx_checkpoints`` a slot), reuse only from a checkpoint or within the window (an
  exact strict extension for recurrent ones), a restored slot without its checkpoints.

Tokens are whitespace-led words, and template markers (``<|im_end|>``) on their own, so a
rendering cut at a message boundary tokenizes to a prefix of the whole. Service time is
injectable (``prompt_s_per_token``, ``gen_s_per_token``), and so are faults (``fail_next``,
``hang_next``, ``drop_next``, ``cut_next``, ``loading``). No randomness.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from testbed import fake_memory
from testbed.fake_memory import Memory, SlotMemory

_TOKEN = re.compile(r"<\|[a-z_]+\|>|\s*(?:(?!<\|)\S)+|\s+")  # special markers alone


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def render_chat(body: dict[str, Any], generation: bool = True) -> str:
    out = []
    if body.get("tools"):
        out.append("<|tools|> " + json.dumps(body["tools"], sort_keys=True) + "\n")
    for message in body.get("messages", []):
        calls = json.dumps(message["tool_calls"]) if message.get("tool_calls") else ""
        out.append(
            f"<|im_start|>{message['role']}\n{_text(message.get('content'))}{calls}<|im_end|>\n"
        )
    if generation:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


@dataclass
class FakeSlot:
    id: int
    tokens: list[str] = field(default_factory=list)
    busy: bool = False
    last_used: int = 0
    task_id: int | None = None
    holder: str = ""  # what runs on it (diagnostics)
    memory: SlotMemory = field(default_factory=SlotMemory)  # pos_min, checkpoints (SWA...)


def reply_words(prompt: list[str], count: int) -> list[str]:
    """The reply to a prompt: a function of the prompt's tokens only (deterministic)."""
    seed = hashlib.sha256("".join(prompt).encode()).digest()
    return [f" w{seed[i % 32] + i}" for i in range(count)]


def _lcp(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


INVALID_KEY = '{"error":{"message":"Invalid API Key","type":"authentication_error","code":401}}'
COUNT_PATHS = (
    "/v1/messages/count_tokens",
    "/chat/completions/input_tokens",
    "/v1/chat/completions/input_tokens",
    "/responses/input_tokens",
    "/v1/responses/input_tokens",
)
# router mode (no model of its own): model management, forwarded by the proxy
ROUTER_ROUTES = (
    ("POST", "/models"),
    ("DELETE", "/models"),
    ("POST", "/models/load"),
    ("POST", "/models/unload"),
)


async def _echo_origin(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer allows the request's origin, as llama-server's defaults do: it echoes the
    ``Origin`` header (empty without one), and names itself ``llama.cpp``."""
    response.headers.setdefault("Access-Control-Allow-Origin", request.headers.get("Origin", ""))
    response.headers["Server"] = "llama.cpp"


EMBEDDINGS = ("/v1/embeddings", "/embeddings", "/embedding")


async def _json(request: web.Request) -> Any:
    """The body as llama-server's JSON parser reads it: a NUL byte ends the input."""
    raw = await request.read()
    end = raw.find(b"\0")
    return json.loads(raw if end < 0 else raw[:end])


def _object_or_empty(body: Any) -> dict[str, Any]:
    """Routes that read a field only if the body has it (any other JSON value has none)."""
    return body if isinstance(body, dict) else {}


class FakeLlamaServer:
    def __init__(
        self,
        n_slots: int = 2,
        n_ctx: int = 8192,
        *,
        prompt_s_per_token: float = 0.0,
        gen_s_per_token: float = 0.0,
        abort_release_s: float = 0.2,
        disconnect_poll_s: float | None = None,
        model: str = "fake-model",
        ram_cache: bool = True,
        ram_tokens: int | None = None,
        save_dir: Path | None = None,
        unified: bool = False,
        cache_idle_slots: bool = True,
        empty_pin_loads_ram: bool = False,
        memory: Memory | None = None,
    ) -> None:
        self.memory = memory or Memory()  # dense; SWA or recurrent: reuse rules of their own
        self._ram_memory: dict[tuple[str, ...], SlotMemory] = {}  # entries' checkpoints
        self.save_dir = save_dir
        self.empty_pin_loads_ram = empty_pin_loads_ram  # True: as if upstream #28139 were fixed
        self.unified = unified
        self.tokens_restored = 0
        self.slot_actions: list[tuple[str, int, str]] = []
        self.save_s = 0.0  # seconds a slot save takes
        self.ram_cache = ram_cache
        self.ram_tokens = ram_tokens  # None: unlimited (--cache-ram -1)
        self.cache_idle_slots = cache_idle_slots  # False: --no-cache-idle-slots
        self.ram: list[list[str]] = []
        self.slots = [FakeSlot(i) for i in range(n_slots)]
        self.n_ctx = n_ctx
        self.prompt_s_per_token = prompt_s_per_token
        self.gen_s_per_token = gen_s_per_token
        self.abort_release_s = abort_release_s
        self.disconnect_poll_s = disconnect_poll_s
        self._result_at = time.monotonic()  # the last task result (``disconnect_poll_s``)
        self._answering: set[int] = set()  # tasks whose stream has begun
        self._done_at: dict[int | None, float] = {}  # a task generating its reply: when it ends
        self.linger_s = 0.0
        self.model = model
        self.loading = False
        self.api_key: str | None = None  # --api-key: every path but /health and / needs it
        self.ui_mcp_proxy = False  # --ui-mcp-proxy: /cors-proxy relays (else 403)
        self.metrics = False  # --metrics: GET /metrics serves Prometheus text (else 501)
        self.sleep_idle_s: float | None = None  # --sleep-idle-seconds (None: -1, never)
        self.sleeping = False
        self._last_task = time.monotonic()
        self.router = False  # started without a model: serves the router's /models routes
        self.sse: list[asyncio.Queue[dict[str, Any]]] = []  # GET /models/sse listeners
        self.started_at = int(time.time())
        self.received: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.queries: list[tuple[str, str]] = []  # each completion's path and raw query
        self.violations: list[str] = []
        self.faults: list[tuple[str, Any]] = []
        self.tokens_processed = 0  # prompt tokens computed (prompt_n), all requests
        self.tokens_prompt = 0  # prompt tokens seen (prompt_n + cache_n)
        self.tokens_warm = 0  # of which in n_predict:0 warm-ups
        self.tokenize_calls = 0
        self._via = ""
        self._clock = 0
        self._task = 0
        self._changed = asyncio.Condition()
        self._compute = asyncio.Lock()
        self._vocab: dict[str, int] = {}
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle ------------------------------------------------------------------------
    def app(self) -> web.Application:
        checks = [self._loading_check, self._key_check, self._not_found]
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=checks)
        app.on_response_prepare.append(_echo_origin)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/v1/health", self.health)
        r.add_get("/props", self.props)
        r.add_get("/slots", self.slots_view)
        for path in ("/v1/models", "/models"):
            r.add_get(path, self.models)
        for path in (
            "/completion",
            "/completions",
            "/v1/completions",
            "/infill",
            "/v1/chat/completions",
            "/chat/completions",
            "/v1/responses",
            "/responses",
            "/v1/messages",
            *EMBEDDINGS,
        ):
            r.add_post(path, self.complete)
        for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
            r.add_post(path, self.rerank)
        for path in COUNT_PATHS:
            r.add_post(path, self.count_tokens)
        r.add_get("/lora-adapters", self.lora_adapters)
        r.add_get("/metrics", self.metrics_page)
        r.add_route("*", "/tools", self.disabled)
        r.add_route("*", "/cors-proxy", self.cors_proxy)
        r.add_post("/slots/{id}", self.slot_action)
        r.add_get("/debug/violations", self.debug_violations)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_post("/apply-template", self.apply_template)
        r.add_route("OPTIONS", "/{path:.*}", self.preflight)
        if self.router:
            for method, path in ROUTER_ROUTES:
                r.add_route(method, path, self.model_action)
            r.add_get("/models/sse", self.model_events)
        return app

    async def start(self, port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.url

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- faults ---------------------------------------------------------------------------
    def fail_next(self, status: int = 500, count: int = 1) -> None:
        self.faults += [("status", status)] * count

    def hang_next(self, count: int = 1) -> None:
        self.faults += [("hang", None)] * count

    def drop_next(self, after_chunks: int = 2, stall: bool = False) -> None:
        """The next streamed answer stops after ``after_chunks`` chunks: the connection is
        closed, or (``stall``) the server goes silent."""
        self.faults.append(("stall" if stall else "drop", after_chunks))

    def cut_next(self, stall: bool) -> None:
        """The next completion's answer stops after its head and a few bytes of its body:
        the server then goes silent (``stall``) or closes the connection."""
        self.faults.append(("cut", stall))

    # -- API key, and routes that run no completion ----------------------------------------
    @web.middleware
    async def _loading_check(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """As llama-server while it loads its model: every path but the page answers 503."""
        if self.loading and request.path != "/":
            error = {"message": "Loading model", "type": "unavailable_error", "code": 503}
            return web.json_response({"error": error}, status=503)
        return await handler(request)

    @web.middleware
    async def _not_found(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """As llama-server: a path it does not serve, or a method the path does not take, is
        a 404 ``File Not Found`` in its JSON error shape."""
        try:
            return await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed):
            error = {"message": "File Not Found", "type": "not_found_error", "code": 404}
            return web.json_response({"error": error}, status=404)

    @web.middleware
    async def _key_check(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """As llama-server: Authorization (Bearer optional), else X-Api-Key."""
        given = request.headers.get("Authorization", "") or request.headers.get("X-Api-Key", "")
        if self.api_key is None or request.path in ("/health", "/v1/health", "/"):
            return await handler(request)
        if given.removeprefix("Bearer ") != self.api_key:
            return web.Response(status=401, text=INVALID_KEY, content_type="application/json")
        return await handler(request)

    async def rerank(self, request: web.Request) -> web.Response:
        """A task on a slot the server picks; no KV reuse (scores: documents' order)."""
        body = await request.json()
        self.received.append((request.path, body, dict(request.headers)))
        documents = body.get("documents") or []
        slots = await self._take_slots(tokenize(str(body.get("query", ""))), -1, 1)
        await self._free(slots, slots[0].task_id)
        results = [{"index": i, "relevance_score": -float(i)} for i in range(len(documents))]
        return web.json_response({"model": self.model, "object": "list", "results": results})

    async def count_tokens(self, request: web.Request) -> web.Response:
        body = await request.json()
        self._wake()
        self.received.append((request.path, body, dict(request.headers)))
        return web.json_response({"input_tokens": len(tokenize(self._prompt("", body)))})

    async def metrics_page(self, request: web.Request) -> web.Response:
        if not self.metrics:
            message = "This server does not support metrics endpoint. Start it with `--metrics`"
            error = {"code": 501, "message": message, "type": "not_supported_error"}
            return web.json_response({"error": error}, status=501)
        self._result()
        busy = sum(slot.busy for slot in self.slots)
        text = (
            "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
            "# TYPE llamacpp:prompt_tokens_total counter\n"
            f"llamacpp:prompt_tokens_total {self.tokens_processed}\n"
            "# HELP llamacpp:requests_processing Number of requests processing.\n"
            "# TYPE llamacpp:requests_processing gauge\n"
            f"llamacpp:requests_processing {busy}\n"
        )
        headers = {"Process-Start-Time-Unix": str(self.started_at)}
        return web.Response(text=text, content_type="text/plain", headers=headers)

    async def lora_adapters(self, request: web.Request) -> web.Response:
        return web.json_response([])

    async def disabled(self, request: web.Request) -> web.Response:
        text = '{"error":{"message":"this feature is disabled","type":"feature_disabled"}}'
        return web.Response(status=403, text=text, content_type="application/json")

    async def cors_proxy(self, request: web.Request) -> web.StreamResponse:
        """``url=...no-content`` answers as llama-server relays a 204: with a chunked body."""
        if not self.ui_mcp_proxy:
            return await self.disabled(request)
        self.received.append((request.path_qs, {}, dict(request.headers)))
        if request.query.get("url", "").endswith("no-content"):
            assert request.transport is not None
            head = b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            request.transport.write(head)
            request.transport.close()
            return web.Response()
        return web.Response(text=f"relayed {request.method} {request.query.get('url')}")

    # -- sleeping (--sleep-idle-seconds) and router mode -----------------------------------
    def _asleep(self) -> bool:
        """Whether it sleeps: idle for ``sleep_idle_s`` since its last task. Going to sleep
        destroys the context: every slot's KV and the RAM prompt cache."""
        idle = time.monotonic() - self._last_task
        stays = self.sleeping or any(slot.busy for slot in self.slots)
        if self.sleep_idle_s is not None and idle >= self.sleep_idle_s and not stays:
            self.sleeping, self.ram = True, []
            for slot in self.slots:
                slot.tokens = []
        return self.sleeping

    def _wake(self) -> None:
        """A task arrived: it wakes the server and restarts the idle timer."""
        self._asleep()
        self.sleeping, self._last_task = False, time.monotonic()

    async def model_action(self, request: web.Request) -> web.Response:
        """POST /models (download), DELETE /models?model=, POST /models/load and /unload."""
        body = await request.json() if request.method == "POST" else {}
        model = request.query.get("model") or body.get("model")
        self.received.append((request.rel_url.raw_path_qs, body, dict(request.headers)))
        for queue in self.sse:
            queue.put_nowait({"model": model, "event": f"{request.method} {request.path}"})
        return web.json_response({"success": True})

    async def model_events(self, request: web.Request) -> web.StreamResponse:
        """One ``data:`` event per model action, as it happens, until the client leaves."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sse.append(queue)
        try:
            while True:
                await response.write(b"data: " + json.dumps(await queue.get()).encode() + b"\n\n")
        finally:
            self.sse.remove(queue)

    # -- metadata endpoints ---------------------------------------------------------------
    async def preflight(self, request: web.Request) -> web.Response:
        """CORS preflight on any path, as llama-server's defaults answer it (the origin is
        echoed on every answer: ``_echo_origin``)."""
        headers = {
            "Access-Control-Allow-Credentials": "true",
            "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
            "Access-Control-Allow-Headers": "*",
        }
        return web.Response(text="", content_type="text/html", headers=headers)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def props(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "is_sleeping": self._asleep(),
                "total_slots": len(self.slots),
                "default_generation_settings": {"n_ctx": self.n_ctx, "params": {}},
                "model_path": f"/models/{self.model}.gguf",
                "model_alias": self.model,
                "build_info": "b0-fake",
            }
        )

    async def slots_view(self, request: web.Request) -> web.Response:
        self._wake()  # a task, like every endpoint but /health, /props, /models and /metrics
        self._result()
        if request.query.get("fail_on_no_slot") and all(s.busy for s in self.slots):
            return web.json_response({"error": {"message": "no slot available"}}, status=503)
        return web.json_response(
            [
                {
                    "id": s.id,
                    "n_ctx": self.n_ctx,
                    "is_processing": s.busy,
                    "id_task": -1 if s.task_id is None else s.task_id,
                    "n_prompt_tokens": len(s.tokens),
                }
                for s in self.slots
            ]
        )

    async def debug_violations(self, request: web.Request) -> web.Response:
        """For tests driving a fake in another process: busy-slot pins seen so far."""
        return web.json_response({"violations": self.violations, "requests": len(self.received)})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        body = _object_or_empty(await _json(request))
        self._wake()
        self.tokenize_calls += 1
        text = body.get("content")  # without it the real server answers no tokens
        words = tokenize(text) if isinstance(text, str) else []
        ids = [self._vocab.setdefault(t, len(self._vocab)) for t in words]
        return web.json_response({"tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = _object_or_empty(await _json(request))
        self._wake()
        words = {v: k for k, v in self._vocab.items()}
        tokens = body.get("tokens") or []  # without them the real server answers no text
        return web.json_response({"content": "".join(words.get(i, "") for i in tokens)})

    async def apply_template(self, request: web.Request) -> web.Response:
        body = await request.json()
        self._wake()
        generation = body.get("add_generation_prompt", True) is not False
        return web.json_response({"prompt": render_chat(body, generation)})

    # -- slot save / restore ---------------------------------------------------------------
    @property
    def n_stream(self) -> int:
        return 1 if self.unified else len(self.slots)

    async def slot_action(self, request: web.Request) -> web.Response:
        if self.save_dir is None:
            return self._error(
                501, "This server does not support slots action.", "not_supported_error"
            )
        action = request.query.get("action", "")
        if action not in ("save", "restore", "erase"):
            return self._error(400, "Invalid action", "invalid_request_error")
        slot = self.slots[int(request.match_info["id"]) % len(self.slots)]
        name = str((await request.json()).get("filename", "")) if action != "erase" else ""
        if action != "erase" and (not name or "/" in name or "\\" in name or ".." in name):
            return self._error(400, "Invalid filename", "invalid_request_error")
        async with self._changed:  # deferred until the slot is idle
            await self._changed.wait_for(lambda: not slot.busy)
        self.slot_actions.append((action, slot.id, name))
        started = time.perf_counter()
        if action == "save" and self.save_s:
            await asyncio.sleep(self.save_s)  # a large KV takes a while to write
        path = self.save_dir / name
        if action == "erase":
            n, slot.tokens = len(slot.tokens), []
            return web.json_response({"id_slot": slot.id, "n_erased": n})
        if action == "save":
            layout = {"n_stream": self.n_stream, "n_ctx": self.n_ctx}
            data = json.dumps({"layout": layout, "tokens": slot.tokens}).encode()
            path.write_bytes(data)
            return _slot_answer(slot.id, name, "saved", "written", len(slot.tokens), data, started)
        try:
            data = path.read_bytes()
            saved = json.loads(data)
            ok = saved["layout"] == {"n_stream": self.n_stream, "n_ctx": self.n_ctx}
            ok = ok and len(saved["tokens"]) < self.n_ctx
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            slot.tokens = []  # a failed restore wipes the slot
            message = (
                "Unable to restore slot: No available space in KV cache or invalid slot save file"
            )
            return self._error(400, message, "invalid_request_error")
        slot.tokens = list(saved["tokens"])
        slot.memory.restored(self.memory, len(slot.tokens), checkpoints=False)
        self.tokens_restored += len(slot.tokens)
        return _slot_answer(slot.id, name, "restored", "read", len(slot.tokens), data, started)

    # -- completion -----------------------------------------------------------------------
    def _prompt(self, path: str, body: dict[str, Any]) -> str:
        if "messages" in body:
            return render_chat(body)
        if path in ("/v1/responses", "/responses"):
            text = body.get("input")
            return text if isinstance(text, str) else json.dumps(text)
        prompt = body.get("prompt", "")
        if isinstance(prompt, dict) and "multimodal_data" not in prompt:
            prompt = prompt.get("prompt_string", "")  # an object holding the prompt's text
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            words = {v: k for k, v in self._vocab.items()}
            return "".join(words.get(t, f" <{t}>") for t in prompt)
        if path == "/infill":
            prompt = body.get("input_prefix", "") + str(prompt) + body.get("input_suffix", "")
        return prompt if isinstance(prompt, str) else json.dumps(prompt)

    def _error(self, status: int, message: str, type_: str) -> web.Response:
        body = {"error": {"code": status, "message": message, "type": type_}}
        return web.json_response(body, status=status)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        if "Content-Encoding" in request.headers:  # as llama-server: no encoded request body
            return web.Response(status=415)
        body = await _json(request)
        self.received.append((request.path, body, dict(request.headers)))
        self.queries.append((request.path, request.rel_url.raw_query_string))
        if self.faults:
            kind, arg = self.faults.pop(0)
            if kind == "status":
                return self._error(arg, "injected failure", "server_error")
            if kind == "hang":
                await asyncio.sleep(3600)
            if kind == "cut":
                return await self._cut(request, stall=arg)
            drop_after, stall = arg, kind == "stall"
        else:
            drop_after, stall = None, False
        if request.path in EMBEDDINGS:  # the real server reads none of a completion's fields
            body = {k: v for k, v in body.items() if k not in ("n", "n_cmpl", "stream")}
        prompt_field = body.get("prompt")
        if isinstance(prompt_field, dict) and "multimodal_data" in prompt_field:
            message = "Multimodal data provided, but model does not support multimodal requests."
            return self._error(400, message, "invalid_request_error")
        batch = _batch(request.path, prompt_field)
        if batch is not None:  # one task per element, each with the request's id_slot
            return await self._batch(request, body, batch)
        prompt = tokenize(self._prompt(request.path, body))
        n = int(body.get("n_cmpl", body.get("n", 1)))
        if n > len(self.slots):
            return self._error(400, "n_cmpl must be <= number of slots", "invalid_request_error")
        if len(prompt) >= self.n_ctx:
            return self._error(
                400, "the request exceeds the available context size", "exceed_context_size_error"
            )
        pinned = body.get("id_slot", -1) if request.path != "/v1/messages" else -1
        self._via = request.headers.get("X-Test-Via", "") + " " + request.path
        slots = await self._take_slots(prompt, pinned, n)
        task, started = slots[0].task_id, time.monotonic()
        try:
            return await self._run(request, body, prompt, slots, drop_after, stall)
        except (asyncio.CancelledError, ConnectionResetError):
            if self.disconnect_poll_s is not None and task not in self._answering:
                await self._until_checked(started, self.disconnect_poll_s, self._done_at.get(task))
            else:
                await asyncio.sleep(self.abort_release_s)
            raise
        finally:
            self._answering.discard(task)
            self._done_at.pop(task, None)
            await self._free(slots, task)

    async def _cut(self, request: web.Request, stall: bool) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.content_length = 1000
        await response.prepare(request)
        await response.write(b'{"choices": [')
        if stall:
            await asyncio.sleep(3600)
        assert request.transport is not None
        request.transport.close()
        return response

    def _result(self) -> None:
        """A task result reached the HTTP side (``disconnect_poll_s``)."""
        self._result_at = time.monotonic()

    async def _until_checked(self, since: float, poll: float, done_at: float | None) -> None:
        """Until the server checks a waiting request's socket: ``poll`` seconds after the
        later of the wait's start and the last task result (each result restarts it); or
        until the task would have generated its whole reply (``done_at``): the server frees
        the slot then, whether anyone reads the answer or not."""
        while True:
            left = max(since, self._result_at) + poll - time.monotonic()
            if done_at is not None:
                left = min(left, done_at - time.monotonic())
            if left <= 0:
                return
            await asyncio.sleep(left)

    def _pick(self, prompt: list[str], pinned: int) -> tuple[FakeSlot | None, bool]:
        """The slot, and whether the RAM-cache hook runs (``update_cache``)."""
        if isinstance(pinned, int) and pinned >= 0:
            slot = self.slots[pinned % len(self.slots)]
            if not slot.tokens:  # f_keep is NaN, which compares False: no cache load
                return slot, self.empty_pin_loads_ram
            # The similarity pass looks at the raw id (an id out of range matches no slot)
            # and takes the slot only past --slot-prompt-similarity (0.1) of the prompt;
            # otherwise f_sim_best stays 0, and so does f_keep: the hook runs.
            lcp = _lcp(slot.tokens, prompt)
            similar = pinned < len(self.slots) and bool(prompt) and lcp / len(prompt) > 0.1
            return slot, not similar or lcp / len(slot.tokens) < 0.5
        idle = [s for s in self.slots if not s.busy]
        best, best_sim = None, 0.1
        for slot in idle:
            if slot.tokens and prompt:
                sim = _lcp(slot.tokens, prompt) / len(prompt)
                if sim > best_sim:
                    best, best_sim = slot, sim
        if best is not None:
            return best, _lcp(best.tokens, prompt) / len(best.tokens) < 0.5
        # the least recently used, the last of equals (``t_last_used <= t_last``)
        return min(reversed(idle), key=lambda s: s.last_used, default=None), True

    def _ram_save(self, tokens: list[str], slot: FakeSlot) -> None:
        if not self.ram_cache or not tokens:
            return
        if self.memory.kind != fake_memory.DENSE:  # an entry carries its slot's checkpoints
            slot.memory.sync(self.memory, len(tokens))
            self._ram_memory[tuple(tokens)] = slot.memory.snapshot()
        if any(_lcp(e, tokens) == len(tokens) for e in self.ram):
            return  # an entry already contains it
        budget = self.ram_tokens
        if budget is not None and len(tokens) > budget:
            return  # larger than the whole cache: skipped
        self.ram = [e for e in self.ram if _lcp(e, tokens) < len(e)]
        while budget is not None and self.ram and sum(map(len, self.ram)) + len(tokens) > budget:
            self.ram.pop()  # the oldest
        self.ram.insert(0, list(tokens))

    def _ram_load(self, slot: FakeSlot, prompt: list[str]) -> None:
        self._ram_save(slot.tokens, slot)
        if not self.ram_cache or not prompt:
            return
        cur_keep = _lcp(slot.tokens, prompt) / len(slot.tokens) if slot.tokens else 0.0
        cur_sim = _lcp(slot.tokens, prompt) / len(prompt)
        best = None
        for entry in reversed(self.ram):  # oldest first, like the server's std::list
            common = _lcp(entry, prompt)
            keep, sim = common / len(entry), common / len(prompt)
            if keep >= 0.25 and keep > cur_keep and sim > cur_sim:
                best, cur_keep, cur_sim = entry, keep, sim
        if best is not None:
            self.ram.remove(best)
            slot.tokens = list(best)
            slot.memory = self._ram_memory.pop(tuple(best), SlotMemory())
            slot.memory.restored(self.memory, len(best), checkpoints=True)

    async def _take_slots(self, prompt: list[str], pinned: int, n: int) -> list[FakeSlot]:
        self._wake()
        waiting = None
        async with self._changed:
            while True:
                slot, update_cache = self._pick(prompt, pinned)
                if slot is not None and slot.busy and waiting is None:
                    waiting = f"pinned busy slot {slot.id}"  # once per request
                    self.violations.append(
                        f"{time.time():.4f} {waiting}: {''.join(prompt)[-40:]!r} via {self._via} "
                        f"while {slot.task_id} {slot.holder}"
                    )
                others = [s for s in self.slots if not s.busy and s is not slot][: n - 1]
                if slot is not None and not slot.busy and len(others) == n - 1:
                    self._task += 1
                    if update_cache:
                        self._ram_load(slot, prompt)
                    for s in [slot, *others]:
                        s.busy, s.task_id = True, self._task
                        s.holder = f"{''.join(prompt)[-40:]!r} via {self._via} at {time.time():.4f}"
                    for idle in self.slots if self.cache_idle_slots else ():
                        if not idle.busy:  # --cache-idle-slots: save every idle slot
                            self._ram_save(idle.tokens, idle)
                            idle.tokens = [] if self.unified else idle.tokens  # and clear it
                    return [slot, *others]
                await self._changed.wait()

    async def _free(self, slots: list[FakeSlot], task: int | None) -> None:
        async with self._changed:
            if not slots[0].busy or slots[0].task_id != task:
                # already freed (a stream frees before its last bytes, as the real one), and
                # maybe taken by the next task since: not freed twice
                return
            self._clock += 1
            self._last_task = time.monotonic()  # the idle timer runs from the task's end
            for i, s in enumerate(slots):
                s.busy, s.last_used = False, self._clock
                if i > 0:
                    s.tokens = []  # child slots are cleared on release
            self._changed.notify_all()

    def _reply(self, prompt: list[str], body: dict[str, Any]) -> list[str]:
        limit = body.get("max_completion_tokens", body.get("max_tokens", body.get("n_predict")))
        count = 8 if limit is None or limit < 0 else max(1, min(int(limit), 256))
        return reply_words(prompt, count)

    async def _run(
        self,
        request: web.Request,
        body: dict[str, Any],
        prompt: list[str],
        slots: list[FakeSlot],
        drop_after: int | None,
        stall: bool = False,
    ) -> web.StreamResponse:
        slot = slots[0]
        reply, final = await self._prefill(body, prompt, slot)
        if body.get("stream"):
            return await self._stream(request, body, reply, final, slots, drop_after, stall)
        self._done_at[slot.task_id] = time.monotonic() + len(reply) * self.gen_s_per_token
        for word in reply:
            await self._gen_step(slot, word)
        slot.tokens = slot.tokens[:-1]
        self._result()
        return web.json_response(_shape(request.path, body, "".join(reply), final, slot, self))

    async def _prefill(
        self, body: dict[str, Any], prompt: list[str], slot: FakeSlot
    ) -> tuple[list[str], dict[str, Any]]:
        """Compute the prompt on the slot (reusing its common prefix); the reply to come and
        the final result's fields."""
        reuse = body.get("cache_prompt", True) is not False
        n_past = _lcp(slot.tokens, prompt) if reuse else 0
        n_past = self._kept(body, prompt, slot, n_past)
        n_past = min(n_past, len(prompt) - 1) if prompt else 0
        slot.tokens = prompt[:n_past]
        processed = len(prompt) - n_past
        self.tokens_processed += processed
        self.tokens_prompt += len(prompt)
        if body.get("n_predict") == 0:
            self.tokens_warm += len(prompt)  # a disk-tier warm-up, not a client's prompt
        prompt_ms = 0.0  # no prefill time modelled: none reported
        if self.prompt_s_per_token:
            started = time.monotonic()
            async with self._compute:
                await asyncio.sleep(processed * self.prompt_s_per_token)
            prompt_ms = (time.monotonic() - started) * 1000  # waiting for the device included
        slot.tokens = list(prompt)
        reply = self._reply(prompt, body)
        timings = {
            "prompt_n": processed,
            "cache_n": n_past,
            "prompt_ms": prompt_ms,
            "predicted_n": len(reply),
            "predicted_ms": 0.0,
        }
        return reply, {"slot": slot.id, "timings": timings, "prompt_tokens": len(prompt)}

    def _kept(self, body: dict[str, Any], prompt: list[str], slot: FakeSlot, n_past: int) -> int:
        """The common prefix the slot's memory still holds (``testbed.fake_memory``), the rest
        of the prompt processed as the server batches it (taking checkpoints)."""
        if self.memory.kind == fake_memory.DENSE:
            return n_past
        state = slot.memory
        state.sync(self.memory, len(slot.tokens))
        n_past = fake_memory.reuse(self.memory, state, n_past, len(prompt))
        chat = "messages" in body or "message_delimiters" in body
        users = fake_memory.user_starts(prompt) if chat else []
        kept = min(n_past, len(prompt) - 1)
        fake_memory.prefill(self.memory, state, kept, len(prompt), users, slot.task_id or 0)
        return n_past

    async def _batch(
        self, request: web.Request, body: dict[str, Any], prompts: list[str]
    ) -> web.StreamResponse:
        """A batch ``prompt``: the server makes a task of each element and gives every one
        the request's ``id_slot`` (a pinned slot busy with an earlier element is a
        violation, as with any pin); results come back in order (OAI: merged ``choices``),
        streamed chunks interleaved, each with its element's ``index``."""
        pinned, path = body.get("id_slot", -1), request.path
        stream: web.StreamResponse | None = None
        if body.get("stream"):
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)

        async def one(index: int, text: str) -> dict[str, Any]:
            prompt = tokenize(text)
            slots = await self._take_slots(prompt, pinned, 1)
            slot, task = slots[0], slots[0].task_id
            try:
                reply, final = await self._prefill(body, prompt, slot)
                for word in reply:
                    await self._gen_step(slot, word)
                    if stream is not None:
                        await stream.write(_sse(_indexed(_chunk(path, word, None), index)))
                slot.tokens = slot.tokens[:-1]
                text = "".join(reply)
                if stream is not None:  # each element's final chunks, with its usage
                    for event in _final_chunks(path, body, text, final, slot, self):
                        if not isinstance(event, bytes):  # (one [DONE] ends them all)
                            await stream.write(_sse(_indexed(event, index)))
                return _indexed(_shape(path, body, text, final, slot, self), index)
            finally:
                await self._free(slots, task)

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        if stream is not None:
            await stream.write(_sse(b"[DONE]"))
            await stream.write_eof()
            return stream
        if path != "/v1/completions":
            return web.json_response(results)
        merged = results[0]
        merged["choices"] = [r["choices"][0] for r in results]
        return web.json_response(merged)

    async def _gen_step(self, slot: FakeSlot, word: str) -> None:
        if self.gen_s_per_token:
            await asyncio.sleep(self.gen_s_per_token)
        slot.tokens.append(word)

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        reply: list[str],
        final: dict[str, Any],
        slots: list[FakeSlot],
        drop_after: int | None,
        stall: bool = False,
    ) -> web.StreamResponse:
        slot, task = slots[0], slots[0].task_id
        assert task is not None  # a taken slot runs a task
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self._answering.add(task)  # a client that leaves now is noticed at the next write
        for i, word in enumerate(reply):
            if drop_after is not None and i == drop_after and stall:
                await asyncio.sleep(3600)
            if drop_after is not None and i == drop_after:
                assert request.transport is not None
                request.transport.close()
                raise ConnectionResetError("injected drop")
            await self._gen_step(slot, word)
            chunk = _chunk(request.path, word, None)
            if body.get("timings_per_token"):  # every token's chunk, as the real server
                chunk["timings"] = {**final["timings"], "predicted_n": i + 1}
            self._result()
            await response.write(_sse(chunk))
        slot.tokens = slot.tokens[:-1]
        await self._free(slots, task)
        for event in _final_chunks(request.path, body, "".join(reply), final, slot, self):
            await response.write(_sse(event))
        await asyncio.sleep(self.linger_s)  # a server slow to close the stream after [DONE]
        await response.write_eof()
        return response


def _slot_answer(
    slot: int, name: str, verb: str, io: str, tokens: int, data: bytes, started: float
) -> web.Response:
    """The answer to a save or restore, shaped like llama-server's (reference §5)."""
    ms = (time.perf_counter() - started) * 1000
    timing = "save_ms" if verb == "saved" else "restore_ms"
    return web.json_response(
        {
            "id_slot": slot,
            "filename": name,
            f"n_{verb}": tokens,
            f"n_{io}": len(data),
            "timings": {timing: ms},
        }
    )


def _batch(path: str, prompt: Any) -> list[str] | None:
    """A batch prompt's elements as text (an array of two or more with no integer), else None."""
    if path not in ("/completion", "/completions", "/v1/completions"):
        return None
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if any(isinstance(e, int) and not isinstance(e, bool) for e in prompt):
        return None
    return [e if isinstance(e, str) else json.dumps(e) for e in prompt]


def _indexed(result: dict[str, Any], index: int) -> dict[str, Any]:
    """A result or chunk of a batch's element ``index``."""
    for choice in result.get("choices", ()):
        choice["index"] = index
    if "choices" not in result:
        result["index"] = index
    return result


def _sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _usage(final: dict[str, Any], reply: str) -> dict[str, Any]:
    t = final["timings"]
    return {
        "prompt_tokens": final["prompt_tokens"],
        "completion_tokens": t["predicted_n"],
        "total_tokens": final["prompt_tokens"] + t["predicted_n"],
        "prompt_tokens_details": {"cached_tokens": t["cache_n"]},
    }


def _chunk(path: str, word: str, finish: str | None) -> dict[str, Any]:
    if path in ("/completion", "/completions", "/infill"):
        return {"content": word, "stop": False, "id_slot": -1}
    if path == "/v1/completions":
        return {
            "object": "text_completion",
            "choices": [{"index": 0, "text": word, "finish_reason": finish}],
        }
    delta = {"content": word} if word else {}
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def _final_chunks(
    path: str,
    body: dict[str, Any],
    text: str,
    final: dict[str, Any],
    slot: FakeSlot,
    server: FakeLlamaServer,
) -> list[Any]:
    if path in ("/completion", "/completions", "/infill"):
        return [_shape(path, body, "", final, slot, server)]
    last = _chunk(path, "", "length")
    out: list[Any] = [last]
    if path == "/v1/completions":  # its last chunk has its usage, include_usage or not
        last["usage"] = _usage(final, text)
        last["timings"] = final["timings"]
    elif (body.get("stream_options") or {}).get("include_usage"):  # timings with the usage
        usage = {"choices": [], "usage": _usage(final, text), "timings": final["timings"]}
        out.append({"object": "chat.completion.chunk", **usage})
    else:
        last["timings"] = final["timings"]
    return [*out, b"[DONE]"]


def _shape(
    path: str,
    body: dict[str, Any],
    text: str,
    final: dict[str, Any],
    slot: FakeSlot,
    server: FakeLlamaServer,
) -> dict[str, Any]:
    timings, usage = final["timings"], _usage(final, text)
    if path in ("/completion", "/completions", "/infill"):
        return {
            "content": text,
            "id_slot": slot.id,
            "stop": True,
            "model": server.model,
            "tokens_predicted": timings["predicted_n"],
            "tokens_evaluated": final["prompt_tokens"],
            "tokens_cached": len(slot.tokens),
            "stop_type": "limit",
            "timings": timings,
        }
    if path == "/v1/completions":
        return {
            "object": "text_completion",
            "model": server.model,
            "usage": usage,
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "timings": timings,
        }
    if path == "/v1/responses":
        return {
            "object": "response",
            "status": "completed",
            "output_text": text,
            "usage": {
                "input_tokens": final["prompt_tokens"],
                "output_tokens": 1,
                "input_tokens_details": {"cached_tokens": timings["cache_n"]},
            },
        }
    if path == "/v1/messages":
        return {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": text}],
            "usage": {
                "input_tokens": final["prompt_tokens"] - timings["cache_n"],
                "cache_read_input_tokens": timings["cache_n"],
                "output_tokens": 1,
            },
        }
    if path in ("/v1/embeddings", "/embeddings"):
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": [0.0] * 8}],
        }
    return {
        "object": "chat.completion",
        "model": server.model,
        "usage": usage,
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "message": {"role": "assistant", "content": text},
            }
        ],
        "timings": timings,
    }


def main() -> None:
    """``python -m testbed.fake_llama --port P --slots N [--gen-ms MS]``: a standalone fake."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--gen-ms", type=float, default=0.0, help="per generated token")
    parser.add_argument("--ctx", type=int, default=8192, help="context size in (word) tokens")
    args = parser.parse_args()

    async def serve() -> None:
        server = FakeLlamaServer(
            n_slots=args.slots, n_ctx=args.ctx, gen_s_per_token=args.gen_ms / 1000
        )
        await server.start(args.port)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()

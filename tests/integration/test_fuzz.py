"""Hostile and broken input: every answer is a 4xx in OpenAI shape or a normal completion.

The proxy (with its disk tier on) and a fake backend run in a background thread; hypothesis
drives raw HTTP requests at every endpoint: malformed JSON, wrong types, huge strings, deep
nesting, invalid UTF-8, negative or huge token limits, out-of-range ``id_slot``, ``n`` over
the slot count, unknown fields and paths. The proxy must never answer a 5xx of its own
(``X-Proxy-Error``), never show a traceback, and keep serving afterwards.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.upstream import ROUTES
from testbed.fake_llama import FakeLlamaServer
from tests.conftest import make_settings


class Served:
    """A backend (a fake, or the real llama-server at ``backend``) and the proxy, served
    from their own event loop in a thread."""

    def __init__(self, save_dir: Path, backend: str | None = None, **settings: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.fake: FakeLlamaServer | None = None
        self.backend = backend
        self._settings = settings
        self.save_dir = save_dir
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self.ready.wait(20)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self.ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        if self.backend is None:
            self.fake = FakeLlamaServer(n_slots=2, save_dir=self.save_dir)
            await self.fake.start()
        url = self.backend or self.fake_server.url
        disk = {"slot_save_dir": str(self.save_dir), "min_tokens": 8}
        config = make_settings([url], disk=disk, **self._settings)
        app = create_app(config, registry=CollectorRegistry())
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    def stop(self) -> None:
        async def shutdown() -> None:
            await self.runner.cleanup()
            if self.fake is not None:
                await self.fake.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    @property
    def fake_server(self) -> FakeLlamaServer:
        assert self.fake is not None
        return self.fake

    def request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server = Served(tmp_path_factory.mktemp("slots"), max_body_bytes=64 * 1024)
    yield server
    server.stop()


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.just("x" * 20_000),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "messages", "prompt", "input", "stream", "n", "n_cmpl", "max_tokens", "max_completion_tokens",
    "n_predict", "id_slot", "model", "tools", "prefix_cache", "cache_prompt", "temperature",
    "input_prefix", "input_suffix", "prompt_cache_key", "user", "stream_options",
]  # fmt: skip
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", 5])},
    optional={"content": values, "tool_calls": values, "name": values},
)
chat_bodies = st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=3)},
    optional={
        "max_tokens": st.integers(-5, 5) | st.just(2**31),
        "n": st.integers(-1, 5),
        "id_slot": st.integers(-3, 9),
        "stream": st.booleans(),
        "prefix_cache": values,
    },
)
raw = st.one_of(
    bodies.map(lambda b: json.dumps(b).encode()),
    chat_bodies.map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=200),
    st.just(b"\xff\xfe{not utf8"),
    st.just(b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    st.just(json.dumps({"prompt": _nested(50)}).encode()),
    st.just(b"{" * 100_000),  # over the body limit
    st.just(b""),
)
PATHS = [p for p, r in ROUTES.items() if r.method == "POST"]
paths = st.sampled_from([*PATHS, "/slots/0?action=save", "/../slots", "/v2/nothing", "/admin/disk"])


def _check(status: int, headers: dict[str, str], body: bytes) -> None:
    assert b"Traceback" not in body
    if headers.get("X-Proxy-Error") == "1":
        assert status < 500, (status, body[:300])
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str)
        assert isinstance(error["type"], str)


# 400 cases a run, however long a case takes (a real server's completions take seconds)
FUZZED = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZED
@given(path=paths, body=raw)
def test_fuzzed_requests_get_4xx_or_a_completion(served: Served, path: str, body: bytes) -> None:
    fuzz_once(served, path, body)


def fuzz_once(served: Served, path: str, body: bytes) -> None:
    """One hostile request: a 4xx in OpenAI shape or the backend's own answer."""
    status, headers, payload = served.request(
        "POST", path, body, {"Content-Type": "application/json"}
    )
    _check(status, headers, payload)
    assert status < 500 or headers.get("X-Proxy-Error") != "1"


def test_proxy_keeps_serving_and_never_pinned_a_busy_slot(served: Served) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "still there?"}]}).encode()
    status, _, _ = served.request("POST", "/v1/chat/completions", body)
    assert status == 200
    assert served.fake_server.violations == []
    # no client ever reached a slot action
    assert all(
        action != "restore" or name.startswith("llp-")
        for action, _, name in served.fake_server.slot_actions
    )


def test_slow_loris_upload_is_cut_off(tmp_path: Path) -> None:
    server = Served(tmp_path, timeouts={"client_body_seconds": 0.5})
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
            )
            started = time.monotonic()
            answer = b""
            try:
                for _ in range(20):
                    time.sleep(0.1)  # a byte every 0.1 s: the slow client is what is tested
                    sock.sendall(b" ")
            except OSError:
                pass  # the proxy closed the connection
            sock.settimeout(5)
            try:
                answer = sock.recv(4096)
            except OSError:
                answer = b""
            assert time.monotonic() - started < 5
        assert answer.startswith(b"HTTP/1.1 408") or answer == b""
        status, _, _ = server.request("GET", "/healthz", None)
        assert status == 200
    finally:
        server.stop()


def _raw(server: Served, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        sock.settimeout(5)
        chunks = []
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError:
            pass
        return b"".join(chunks)


def test_smuggling_and_traversal_never_reach_a_backend(served: Served) -> None:
    before = len(served.fake_server.received)
    actions = len(served.fake_server.slot_actions)
    body = b'{"prompt": "x"}'
    both = (
        b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nPOST /slots/0?action=erase HTTP/1.1\r\n\r\n"
    )
    answer = _raw(served, both)  # aiohttp's HTTP parser refuses it before the app runs
    assert answer.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request")
    for path in (
        "/v1/chat/completions/../../slots/0?action=erase",
        "/%2e%2e/slots/0?action=save",
        "/slots/0?action=restore",
        "//slots/0",
        "/v1/chat/completions%00",
    ):
        status, _, _ = served.request("POST", path, body, {"Content-Type": "application/json"})
        assert status in (400, 403, 404), path
    assert len(served.fake_server.slot_actions) == actions  # no client reached a slot action
    forwarded = [p for p, _, _ in served.fake_server.received[before:]]
    assert set(forwarded) <= {p for p, r in ROUTES.items()}


def test_admin_endpoints_are_off_without_a_token(served: Served) -> None:
    for path in ("/admin/slots", "/admin/disk"):
        status, headers, _ = served.request("GET", path, None)
        assert status == 404
        assert headers.get("X-Proxy-Error") == "1"

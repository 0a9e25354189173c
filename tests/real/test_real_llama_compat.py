"""The proxy as a drop-in llama-server, against real llama-servers: /health, API keys, and
the routes it forwards answering as the server answers directly."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from proxy.app import SCHEDULER
from testbed.stack import LlamaServer
from tests.conftest import chat
from tests.integration.test_llama_compat import TAKEN
from tests.waiting import until

KEY = {"Authorization": "Bearer k"}


async def _direct(server: LlamaServer, method: str, path: str, body: Any, headers: Any) -> Any:
    url = server.url + path
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, json=body, headers=headers) as resp,
    ):
        return resp.status, await resp.read()


async def _until_ready(client: Any) -> None:
    deadline = time.monotonic() + 30
    while (await client.get("/readyz")).status != 200:
        assert time.monotonic() < deadline, "proxy not ready"
        await asyncio.sleep(0.1)


async def test_health_through_the_proxy_equals_the_servers(llama_servers: Any, proxy: Any) -> None:
    server = llama_servers(slots=2)
    client = await proxy([server.url])
    await _until_ready(client)
    for path in ("/health", "/v1/health"):
        resp = await client.get(path)
        assert (resp.status, await resp.read()) == await _direct(server, "GET", path, None, {})


async def test_an_origin_is_allowed_on_the_proxys_own_answers_as_the_server_allows_it(
    llama_servers: Any, proxy: Any
) -> None:
    """A browser app on another origin: its first request may be one the proxy answers
    itself (the health check, an unknown path). The server allows every origin by default
    (it echoes ``Origin``), and so does the proxy, before any answer was forwarded to it."""
    server = llama_servers(slots=1)
    client = await proxy([server.url])
    await _until_ready(client)
    origin = {"Origin": "http://app.example"}
    async with aiohttp.ClientSession() as session:
        for path in ("/health", "/nope"):
            async with session.get(server.url + path, headers=origin) as direct:
                allowed = direct.headers.get("Access-Control-Allow-Origin")
            resp = await client.get(path, headers=origin)
            assert resp.headers.get("Access-Control-Allow-Origin") == allowed == origin["Origin"]


async def test_the_servers_static_files_and_404s_come_through_the_proxy(
    llama_servers: Any, proxy: Any, tmp_path: Any
) -> None:
    """A server started with ``--path`` serves a web app (llama.cpp's web UI is served so):
    its files, and its 404 for what it does not serve, reach a browser through the proxy as
    they would directly."""
    (tmp_path / "index.html").write_text("<html><body>chat</body></html>")
    (tmp_path / "app.js").write_text("console.log('chat');")
    server = llama_servers(slots=1, extra=("--path", str(tmp_path)))
    client = await proxy([server.url])
    await _until_ready(client)
    for path in ("/", "/app.js", "/nope.js", "/v1/chat/completions"):
        resp = await client.get(path)
        direct = await _direct(server, "GET", path, None, {})
        assert (resp.status, await resp.read()) == direct, path
    assert (await client.get("/")).headers["Content-Type"].startswith("text/html")


async def test_backend_with_api_key_works_with_the_key_and_stays_up_without(
    llama_servers: Any, proxy: Any
) -> None:
    server = llama_servers(slots=2, extra=("--api-key", "k"))
    keyed = await proxy([{"url": server.url, "api_key": "k"}])
    await _until_ready(keyed)
    body = chat("Say hi.", max_tokens=4, temperature=0)
    assert (await keyed.post("/v1/chat/completions", json=body, headers=KEY)).status == 200
    # with no api_key of its own the proxy checks the backend's: refused as the server refuses
    resp = await keyed.post("/v1/chat/completions", json=body)
    assert (resp.status, await resp.read()) == await _direct(
        server, "POST", "/v1/chat/completions", body, {}
    )
    bare = await proxy([server.url])
    await _until_ready(bare)  # /slots and /props answer 401: ready all the same
    assert (await bare.post("/v1/chat/completions", json=body, headers=KEY)).status == 200
    resp = await bare.post("/v1/chat/completions", json=body)
    assert (resp.status, await resp.read()) == await _direct(
        server, "POST", "/v1/chat/completions", body, {}
    )


async def test_proxy_api_key_answers_as_llama_servers(llama_servers: Any, proxy: Any) -> None:
    server = llama_servers(slots=2, extra=("--api-key", "k"))
    client = await proxy([{"url": server.url, "api_key": "k"}], api_key="k")
    await _until_ready(client)
    for headers in ({}, {"X-Api-Key": "no"}, {"Authorization": "Bearer no"}):
        resp = await client.post("/tokenize", json={"content": "a"}, headers=headers)
        direct = await _direct(server, "POST", "/tokenize", {"content": "a"}, headers)
        assert (resp.status, await resp.read()) == direct
    for headers in (KEY, {"X-Api-Key": "k"}):
        resp = await client.post("/tokenize", json={"content": "a"}, headers=headers)
        direct = await _direct(server, "POST", "/tokenize", {"content": "a"}, headers)
        assert (resp.status, await resp.read()) == direct
    for path in ("/", "/index.html"):  # the web UI's page needs no key; a file does
        resp = await client.get(path)
        assert (resp.status, await resp.read()) == await _direct(server, "GET", path, None, {})


async def test_bodies_the_server_takes_and_its_server_header_come_through(
    llama_servers: Any, proxy: Any
) -> None:
    """Each body of ``TAKEN`` (a NUL that ends it, a field its route does not read, any JSON
    value on ``/tokenize``) answers as directly, and every answer names the same server."""
    server = llama_servers(slots=2, extra=("--embeddings", "--pooling", "mean"))
    client = await proxy([server.url])
    await _until_ready(client)
    kind = {"Content-Type": "application/json"}
    same = ("/tokenize", "/detokenize", "/v1/embeddings")  # (the others stamp ids and times)
    async with aiohttp.ClientSession() as session:
        for path, raw in TAKEN:
            async with session.post(server.url + path, data=raw, headers=kind) as direct:
                expected = (direct.status, await direct.read(), direct.headers.get("Server"))
            resp = await client.post(path, data=raw, headers=kind)
            got = (resp.status, await resp.read(), resp.headers.get("Server"))
            assert got[0] == expected[0] == 200, (path, raw, got[1])
            assert got[2] == expected[2] == "llama.cpp"
            if path in same:
                assert got[1] == expected[1], (path, raw)


async def _status_line(host: str, port: int, head: bytes) -> bytes:
    """The status line a server answers a raw request head with (empty: it closed first)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head)
        await writer.drain()
        return (await reader.readline()).strip()
    except ConnectionError:
        return b""
    finally:
        writer.close()


async def test_the_http_parser_takes_what_the_servers_takes(llama_servers: Any, proxy: Any) -> None:
    """At llama-server's limits: a request line of 32,766 bytes, a header line of 8,190,
    100 header lines; one line more, or a header value over 8,190 bytes, is a 400. A longer
    request line: the server closes without an answer, the proxy answers 400. (aiohttp
    bounds a header's value, not its line: a line of 8,191 to 8,190 + name bytes passes.)"""
    server = llama_servers(slots=1)
    client = await proxy([server.url])
    await _until_ready(client)
    line = b"GET /health?x=" + b"a" * (32766 - len(b"GET /health?x= HTTP/1.1")) + b" HTTP/1.1"
    heads = {
        "longest line": line + b"\r\nHost: x\r\n\r\n",
        "longest header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 8185 + b"\r\n\r\n",
        "a header too long": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: "
        + b"a" * 8191
        + b"\r\n\r\n",
    }
    for count in (100, 101):
        lines = b"".join(b"X-%d: a\r\n" % i for i in range(count - 1))
        heads[f"{count} headers"] = b"GET /health HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n"
    host, port = server.url.removeprefix("http://").split(":")
    direct, proxied = (host, int(port)), (str(client.server.host), int(client.server.port or 0))
    got = {name: (await _status_line(*proxied, head))[9:12] for name, head in heads.items()}
    expected = {name: (await _status_line(*direct, head))[9:12] for name, head in heads.items()}
    assert got == expected
    assert list(expected.values()) == [b"200", b"200", b"400", b"200", b"400"]
    longer = line.replace(b"?x=", b"?x=a") + b"\r\nHost: x\r\n\r\n"
    assert await _status_line(*direct, longer) == b""
    assert (await _status_line(*proxied, longer))[9:12] == b"400"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        (
            "POST",
            "/v1/messages/count_tokens",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        ),
        ("POST", "/chat/completions/input_tokens", chat("hi")),
        ("POST", "/v1/responses/input_tokens", {"input": "hi"}),
        ("POST", "/embedding", {"content": "hi"}),
        ("POST", "/rerank", {"query": "q", "documents": ["a", "b"]}),
        ("POST", "/v1/reranking", {"query": "q", "documents": ["a"]}),
        ("GET", "/lora-adapters", None),
        ("GET", "/tools", None),
        ("POST", "/tools", {}),
        ("GET", "/cors-proxy", None),
        ("POST", "/responses", {"input": "Say hi.", "max_output_tokens": 4, "temperature": 0}),
    ],
)
async def test_new_routes_answer_as_the_server_directly(
    llama_servers: Any, proxy: Any, method: str, path: str, body: Any
) -> None:
    server = llama_servers(slots=2)
    client = await proxy([server.url])
    await _until_ready(client)
    resp = await client.request(method, path, json=body)
    status, direct = await _direct(server, method, path, body, {})
    got = await resp.read()
    assert resp.status == status, got
    if path != "/responses":  # (ids and timestamps differ from call to call)
        assert got == direct


async def test_a_cors_preflight_answers_as_the_server(llama_servers: Any, proxy: Any) -> None:
    server = llama_servers(slots=1, extra=("--api-key", "k"))
    client = await proxy([{"url": server.url, "api_key": "k"}], api_key="k")
    await _until_ready(client)
    ask = {"Origin": "http://web.example", "Access-Control-Request-Method": "POST"}
    cors = ("Access-Control-Allow-Origin", "Access-Control-Allow-Methods")
    for path in ("/completions", "/v1/chat/completions"):
        async with (
            aiohttp.ClientSession() as session,
            session.options(server.url + path, headers=ask) as direct,
        ):
            expected = (direct.status, [direct.headers.get(h) for h in cors])
        resp = await client.options(path, headers=ask)
        assert (resp.status, [resp.headers.get(h) for h in cors]) == expected
        assert expected[0] == 200


async def test_the_proxys_own_answers_carry_the_servers_cors_headers(
    llama_servers: Any, proxy: Any
) -> None:
    """A browser page on another origin reads the proxy's own answers (``/health``,
    ``/metrics``, its errors) as it reads the server's: once a forwarded answer to that origin
    showed the server's CORS headers, they carry the same, and before, what the server gives
    any origin (``http.cors``)."""
    server = llama_servers(slots=1)
    client = await proxy([server.url])
    page = {"Origin": "http://app.example"}
    acao = "Access-Control-Allow-Origin"
    forwarded = await client.post("/tokenize", json={"content": "hi"}, headers=page)
    async with aiohttp.ClientSession() as direct:
        async with direct.post(server.url + "/tokenize", json={"content": "hi"}, headers=page) as r:
            assert forwarded.headers.get(acao) == r.headers.get(acao) == "http://app.example"
        for method, path, body in (
            ("GET", "/health", None),
            ("GET", "/metrics", None),
            ("POST", "/completion", b"{oops"),
            ("GET", "/no-such-path", None),
        ):
            async with direct.request(method, server.url + path, data=body, headers=page) as r:
                expected = r.headers.get(acao)
            resp = await client.request(method, path, data=body, headers=page)
            assert resp.headers.get(acao) == expected == "http://app.example", path
        # an origin no forwarded answer showed yet: allowed as the server allows any
        other = {"Origin": "http://other.example"}
        async with direct.get(server.url + "/health", headers=other) as r:
            expected = r.headers.get(acao)
        resp = await client.get("/health", headers=other)
        assert resp.headers.get(acao) == expected == "http://other.example"


async def test_an_idle_server_sleeps_behind_the_proxy_and_wakes_with_no_cache(
    llama_servers: Any, proxy: Any
) -> None:
    """``--sleep-idle-seconds``: the proxy's probes (every 0.2 s here) let the server sleep,
    and a sleep destroys its context: the same prompt then reuses nothing, as the proxy
    predicts."""
    server = llama_servers(slots=2, extra=("--sleep-idle-seconds", "1"))
    client = await proxy([server.url], health={"interval_seconds": 0.2})
    await _until_ready(client)
    body = {"prompt": "The history of the printing press " * 8, "n_predict": 2}
    first = await (await client.post("/completion", json=body)).json()
    assert first["timings"]["prompt_n"] > 30
    deadline = time.monotonic() + 20
    while not (await (await client.get("/props")).json())["is_sleeping"]:
        assert time.monotonic() < deadline, "the proxy's probes kept the server awake"
        await asyncio.sleep(0.1)
    backend = client.server.app[SCHEDULER].fleet.backends[0]
    await until(lambda: backend.asleep, "the proxy's probes see the server asleep")
    resp = await client.post("/completion", json=body)
    assert (await resp.json())["timings"]["cache_n"] == 0
    assert resp.headers["X-Cache-Predicted-Tokens"] == "0"

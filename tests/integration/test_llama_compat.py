"""The proxy as a drop-in llama-server: /health, waiting for backends, API keys, every route."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from proxy.app import SCHEDULER
from testbed.fake_llama import COUNT_PATHS, INVALID_KEY, ROUTER_ROUTES, FakeLlamaServer
from testbed.stack import free_port
from tests.conftest import chat
from tests.waiting import until, until_metric

LOADING = b'{"error":{"message":"Loading model","type":"unavailable_error","code":503}}'


@pytest.mark.parametrize("path", ["/health", "/v1/health"])
async def test_health_answers_as_llama_server_loading_then_ok(
    fakes: Any, proxy: Any, path: str
) -> None:
    fake = await fakes()
    fake.loading = True
    client = await proxy([fake])
    resp = await client.get(path)
    assert (resp.status, await resp.read()) == (503, LOADING)
    assert resp.headers["Content-Type"] == "application/json; charset=utf-8"
    fake.loading = False

    async def ok() -> bool:
        return bool((await client.get(path)).status == 200)

    await until(ok, "the proxy's health turns ok")
    resp = await client.get(path)
    assert (resp.status, await resp.read()) == (200, b'{"status":"ok"}')


async def test_requests_wait_for_a_backend_not_up_at_start(fakes: Any, proxy: Any) -> None:
    port = free_port()
    client = await proxy([f"http://127.0.0.1:{port}"], health={"interval_seconds": 0.1})
    started = time.monotonic()
    pinned = asyncio.create_task(client.post("/completion", json={"prompt": "x"}))
    unpinned = asyncio.create_task(client.post("/tokenize", json={"content": "x"}))
    in_flight = "llama_cache_proxy_requests_in_flight"
    await until_metric(client, in_flight, lambda n: n == 3)  # both, and the scrape
    await asyncio.sleep(0.5)  # the time passing is the point: they outlast failed probes
    assert not pinned.done()
    assert not unpinned.done()
    await fakes(port=port)
    assert (await pinned).status == 200
    assert (await unpinned).status == 200
    assert time.monotonic() - started < 3.0  # woken by the probe, not by the 5 s bound


async def test_no_backend_up_waits_the_queue_bound_then_503(proxy: Any) -> None:
    client = await proxy(["http://127.0.0.1:9"], queue={"max_wait_seconds": 0.3})
    for path, body in (("/v1/chat/completions", chat("hi")), ("/tokenize", {"content": "x"})):
        started = time.monotonic()
        resp = await client.post(path, json=body)
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "no_backend"
        assert time.monotonic() - started >= 0.3


async def test_backend_key_is_sent_on_probes_and_in_place_of_the_clients(
    fakes: Any, proxy: Any
) -> None:
    fake = await fakes(n_slots=2)
    fake.api_key = "backend-key"
    client = await proxy([{"url": fake.url, "api_key": "backend-key"}], api_key="client-key")
    headers = {"Authorization": "Bearer client-key", "X-Api-Key": "client-key"}
    resp = await client.post("/completion", json={"prompt": "x"}, headers=headers)
    assert resp.status == 200
    sent = fake.received[-1][2]
    assert sent["Authorization"] == "Bearer backend-key"
    assert "X-Api-Key" not in sent
    assert len(client.app[SCHEDULER].fleet.backends[0].slots) == 2  # /slots was read


async def test_without_its_own_keys_the_proxy_refuses_what_its_keyed_backend_would(
    fakes: Any, proxy: Any
) -> None:
    """A backend's key is sent in place of the client's: with no ``api_key`` of the proxy's
    own, the proxy checks the backend's key, or anyone reaching it would use that key."""
    fake = await fakes(n_slots=2)
    fake.api_key = "backend-key"
    client = await proxy([{"url": fake.url, "api_key": "backend-key"}])
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = await client.post("/completion", json={"prompt": "x"}, headers=headers)
        assert (resp.status, await resp.read()) == (401, INVALID_KEY.encode())
        assert (await client.get("/metrics", headers=headers)).status == 401
    assert (await client.get("/health")).status == 200
    resp = await client.post(
        "/completion", json={"prompt": "x"}, headers={"X-Api-Key": "backend-key"}
    )
    assert resp.status == 200


async def test_backend_with_a_key_the_proxy_lacks_stays_ready(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=2)
    fake.api_key = "k"
    client = await proxy([fake])
    assert (await client.get("/readyz")).status == 200
    assert len(client.app[SCHEDULER].fleet.backends[0].slots) == 1  # /slots, /props: 401
    resp = await client.post("/completion", json={"prompt": "x"}, headers={"X-Api-Key": "k"})
    assert resp.status == 200
    assert fake.received[-1][2]["X-Api-Key"] == "k"  # the client's key passes through
    resp = await client.post("/completion", json={"prompt": "x"})
    assert (resp.status, await resp.read()) == (401, INVALID_KEY.encode())
    assert (await client.get("/readyz")).status == 200


async def test_proxy_key_is_checked_as_llama_server_checks_it(fakes: Any, proxy: Any) -> None:
    fake = await fakes()
    client = await proxy([fake], api_key="k1,k2")
    for headers in ({}, {"Authorization": "Bearer nope"}, {"X-Api-Key": "nope"}):
        resp = await client.post("/completion", json={"prompt": "x"}, headers=headers)
        assert (resp.status, await resp.read()) == (401, INVALID_KEY.encode())
    assert (await client.get("/metrics")).status == 401
    for headers in ({"Authorization": "Bearer k1"}, {"Authorization": "k2"}, {"X-Api-Key": "k1"}):
        resp = await client.post("/completion", json={"prompt": "x"}, headers=headers)
        assert resp.status == 200
    for path in ("/health", "/v1/health", "/healthz", "/readyz"):
        assert (await client.get(path)).status == 200
    # the web UI's page needs no key either (the fake serves none: its 404), a file does
    assert (await client.get("/")).status == 404
    assert (await client.get("/index.html")).status == 401


async def test_every_answer_names_its_server_as_llama_server_does(fakes: Any, proxy: Any) -> None:
    """``Server: llama.cpp`` on forwarded answers and on the proxy's own (its health check, a
    refused key, a bad body, an unknown path), never the proxy's stack."""
    client = await proxy([await fakes()], api_key="k")
    key = {"Authorization": "Bearer k"}
    answers = [
        await client.get("/health"),
        await client.get("/props", headers=key),
        await client.post("/completion", json={"prompt": "x"}, headers=key),
        await client.post("/completion", json={"prompt": "x"}),
        await client.post("/completion", data=b"{", headers=key),
        await client.post("/nope", json={}, headers=key),
        await client.get("/metrics", headers=key),
    ]
    assert [r.headers.get("Server") for r in answers] == ["llama.cpp"] * len(answers)
    assert [r.status for r in answers] == [200, 200, 200, 401, 400, 404, 200]


# bodies llama-server answers 200 that a stricter reading would refuse (its parser stops at a
# NUL; a route reads only its own fields; /tokenize and /detokenize read any JSON value)
TAKEN = [
    ("/tokenize", b"[]"),
    ("/tokenize", b"null"),
    ("/detokenize", b"5"),
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"prompt":true}'),
    ("/v1/responses", b'{"input":"hi","prompt":1}'),
    ("/v1/embeddings", b'{"input":"hi","stream":"no","n":0,"prompt":5}'),
    ("/completion", b'{"prompt":"hi","n_predict":2}\x00'),
]


@pytest.mark.parametrize(("path", "raw"), TAKEN)
async def test_a_body_llama_server_takes_is_taken(
    fakes: Any, proxy: Any, path: str, raw: bytes
) -> None:
    fake = await fakes()
    client = await proxy([fake])
    resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 200, await resp.text()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/responses", {"input": "hello"}),
        ("/embedding", {"content": "hello"}),
        *[(p, {"query": "q", "documents": ["a", "b"]}) for p in ("/rerank", "/v1/reranking")],
        *[(p, chat("count me")) for p in COUNT_PATHS],
    ],
)
async def test_llama_server_routes_are_forwarded(
    fakes: Any, proxy: Any, path: str, body: dict[str, Any]
) -> None:
    fake = await fakes()
    client = await proxy([fake])
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    assert fake.received[-1][0] == path


async def test_get_routes_and_disabled_features_pass_through(fakes: Any, proxy: Any) -> None:
    fake = await fakes()
    client = await proxy([fake])
    assert await (await client.get("/lora-adapters")).json() == []
    assert isinstance(await (await client.get("/slots")).json(), list)
    for method in ("GET", "POST"):
        resp = await client.request(method, "/tools", json={})
        text = b'{"error":{"message":"this feature is disabled","type":"feature_disabled"}}'
        assert (resp.status, await resp.read()) == (403, text)


async def test_cors_proxy_keeps_the_query_and_its_malformed_204(fakes: Any, proxy: Any) -> None:
    fake = await fakes()
    fake.ui_mcp_proxy = True
    client = await proxy([fake])
    resp = await client.get("/cors-proxy?url=http://example.com/a%20b")
    assert await resp.text() == "relayed GET http://example.com/a b"
    assert fake.received[-1][0] == "/cors-proxy?url=http://example.com/a%20b"
    for _ in range(2):  # (the connection the 204 came on is not reused)
        resp = await client.post("/cors-proxy?url=http://t/no-content", data=b"{}")
        assert (resp.status, await resp.read()) == (204, b"")
    assert (await client.post("/completion", json={"prompt": "x"})).status == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/slots/0?action=save"),
        ("POST", "/props"),
        ("POST", "/lora-adapters"),
        ("POST", "/v1/chat/completions/control"),
        ("GET", "/v1/stream?id=x"),
        ("DELETE", "/v1/stream?id=x"),
    ],
)
async def test_refused_routes_say_why(fakes: Any, proxy: Any, method: str, path: str) -> None:
    fake = await fakes()
    client = await proxy([fake])
    resp = await client.request(method, path, json={})
    assert resp.status == 403
    error = (await resp.json())["error"]
    assert error["code"] == "refused_by_proxy"
    assert "not served through the proxy: " in error["message"]
    assert fake.received == []


async def test_rerank_waits_for_a_whole_idle_backend(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=2, gen_s_per_token=0.05)
    client = await proxy([fake])
    slow = asyncio.create_task(client.post("/completion", json={"prompt": "x", "n_predict": 10}))
    await until(lambda: any(s.busy for s in fake.slots), "the completion runs")
    resp = await client.post("/rerank", json={"query": "q", "documents": ["a"]})
    assert resp.status == 200
    assert slow.done()  # it waited for the completion: the server picks the rerank's slot
    assert fake.violations == []


async def test_a_cors_preflight_on_any_path_is_the_backends_answer(fakes: Any, proxy: Any) -> None:
    fake = await fakes()
    client = await proxy([fake], api_key="k")  # a preflight carries no key
    for path in ("/completions", "/v1/chat/completions", "/health", "/anything"):
        resp = await client.options(
            path, headers={"Origin": "http://x", "Access-Control-Request-Method": "POST"}
        )
        assert resp.status == 200, path
        assert resp.headers["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
        assert resp.headers["Access-Control-Allow-Origin"] == "http://x"


async def test_the_proxys_own_answers_allow_an_origin_as_its_backends_allow_any(
    fakes: Any, proxy: Any
) -> None:
    """A browser app's first request may be one the proxy answers itself (its health check,
    an error): it carries the CORS headers llama-server gives any origin (it echoes the
    origin, as the backends echoed the proxy's probe), or the browser hides the answer."""
    fake = await fakes()
    client = await proxy([fake])
    await until(lambda: client.app[SCHEDULER].fleet.backends[0].slots != [], "probed")
    for path, status in (("/health", 200), ("/nope", 404)):
        resp = await client.get(path, headers={"Origin": "http://app.example"})
        assert resp.status == status
        assert resp.headers["Access-Control-Allow-Origin"] == "http://app.example", path


async def test_router_model_management_is_forwarded_and_its_events_relayed_as_they_come(
    proxy: Any,
) -> None:
    fake = FakeLlamaServer()
    fake.router = True
    await fake.start()
    try:
        client = await proxy([fake])
        events = await client.get("/models/sse")
        assert events.status == 200
        await until(lambda: len(fake.sse) == 1, "the proxy listens to the events")
        for method, path in ROUTER_ROUTES:
            query = "?model=org/m" if method == "DELETE" else ""
            body = None if method == "DELETE" else {"model": "org/m"}
            resp = await client.request(method, path + query, json=body)
            assert (resp.status, await resp.json()) == (200, {"success": True}), path
            assert fake.received[-1][0] == path + query
            line = await asyncio.wait_for(events.content.readline(), 5)  # the stream is open
            assert json.loads(line.removeprefix(b"data: ")) == {
                "model": "org/m",
                "event": f"{method} {path}",
            }
            assert await events.content.readline() == b"\n"
        events.close()
    finally:
        await fake.stop()

"""Queueing, failures and bad input, against fake llama-servers."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import signal
import sys
import time
from asyncio.subprocess import Process
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.app import PROBER, SCHEDULER, create_app
from proxy.state.memory import InMemoryStateStore
from testbed.fake_llama import FakeLlamaServer
from testbed.probes import metric, server_timing
from testbed.stack import free_port
from tests.conftest import REPLICA_SECRET, chat, make_settings
from tests.waiting import ADMIN, admin_view, until, until_down, until_metric, until_ready


def _is_openai_error(body: dict[str, Any]) -> bool:
    error = body.get("error")
    return isinstance(error, dict) and {"message", "type", "code"} <= error.keys()


async def test_more_requests_than_slots_all_complete_without_pinning_a_busy_slot(
    fakes: Any, proxy: Any
) -> None:
    fake_a = await fakes(n_slots=2, gen_s_per_token=0.002)
    fake_b = await fakes(n_slots=2, gen_s_per_token=0.002)
    client = await proxy([fake_a, fake_b])
    bodies = [chat(f"request number {i}", max_tokens=8, stream=i % 2 == 0) for i in range(24)]
    responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
    assert [r.status for r in responses] == [200] * 24
    texts = [await r.text() for r in responses]
    assert all("w" in t for t in texts)
    assert fake_a.violations == fake_b.violations == []
    assert fake_a.received
    assert fake_b.received


async def test_full_queue_answers_503_with_retry_after(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=1, gen_s_per_token=0.05)
    client = await proxy([fake], queue={"max_waiting": 1, "retry_after_seconds": 3})
    body = chat("slow", max_tokens=10)
    tasks = [asyncio.create_task(client.post("/v1/chat/completions", json=body)) for _ in range(4)]
    statuses = sorted([(await t).status for t in tasks])
    assert statuses == [200, 200, 503, 503]
    rejected = next(t.result() for t in tasks if t.result().status == 503)
    assert rejected.headers["Retry-After"] == "3"
    assert _is_openai_error(await rejected.json())


async def test_wait_past_limit_answers_503(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=1, gen_s_per_token=0.1)
    client = await proxy([fake], queue={"max_wait_seconds": 0.1})
    body = chat("slow", max_tokens=20)
    first = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    await until(lambda: fake.slots[0].busy, "the first request holds the only slot")
    second = await client.post("/v1/chat/completions", json=body)
    assert second.status == 503
    assert (await second.json())["error"]["code"] == "wait_timeout"
    assert (await first).status == 200


def _turns(count: int) -> dict[str, Any]:
    """A session's turn ``count``: a long system prompt, then its questions and answers."""
    messages = [{"role": "system", "content": "You answer questions about fruit. " * 300}]
    for i in range(count):
        messages.append({"role": "user", "content": f"question {i} about apples"})
        if i < count - 1:
            messages.append({"role": "assistant", "content": f"answer {i}"})
    return {"messages": messages, "max_tokens": 2}


@pytest.mark.parametrize(
    ("queue", "waited"),
    [({"max_waiting": 0}, False), ({"max_wait_seconds": 0.3}, True)],
    ids=["no-place", "queue-bound"],
)
async def test_a_request_that_may_not_wait_takes_the_idle_slot_beside_a_busy_one(
    fakes: Any, proxy: Any, queue: dict[str, Any], waited: bool
) -> None:
    """A session's turn runs on one slot; the other is idle. The same turn again waits for
    the busy slot (it saves the whole conversation); when it may not wait (no queue place,
    or the queue's bound comes before ``max_slot_wait_seconds``) it takes the idle slot
    rather than a 503 beside it; its route says whether it waited first."""
    fake = await fakes(n_slots=2, gen_s_per_token=0.05)
    client = await proxy([fake], queue=queue, routing={"max_slot_wait_seconds": 10})
    assert (await client.post("/v1/chat/completions", json=_turns(1))).status == 200
    running = asyncio.create_task(
        client.post("/v1/chat/completions", json={**_turns(2), "max_tokens": 40})
    )
    await until(lambda: any(s.busy for s in fake.slots), "the session's turn runs")
    again = await client.post("/v1/chat/completions", json=_turns(2))
    assert again.status == 200, await again.text()
    assert again.headers["X-Cache-Route"].startswith("wait+") is waited
    assert not running.done()  # it did not wait for the busy slot to end
    assert (await running).status == 200
    assert fake.violations == []


@contextlib.asynccontextmanager
async def _served(backend: str) -> AsyncIterator[tuple[Process, aiohttp.ClientSession, str]]:
    """``python -m proxy serve`` in front of ``backend``, once ready: its process (stderr
    piped), a client session and its URL; killed at the end if it is still running."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = ["-m", "proxy", "serve", "--backend", backend, "--listen", f"127.0.0.1:{port}"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *serve, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    try:
        async with aiohttp.ClientSession() as session:

            async def up() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(url + "/readyz") as resp:
                        return resp.status == 200
                return False

            await until(up, "the proxy is ready", within=30)
            yield proc, session, url
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_requests_waiting_at_shutdown_are_answered_503(fakes: Any) -> None:
    """SIGTERM while one request runs and two wait for the only slot: the two get a 503
    with ``Retry-After`` (they never reached a backend), the process ends at once, cleanly."""
    fake = await fakes(n_slots=1, gen_s_per_token=0.05)
    async with _served(fake.url) as (proc, session, url):

        async def post(text: str) -> tuple[int, Any, dict[str, str]]:
            body = chat(text, max_tokens=200)
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                return resp.status, await resp.json(), dict(resp.headers)

        async def two_queued() -> bool:
            async with session.get(url + "/metrics") as resp:
                return metric(await resp.text(), "llama_cache_proxy_requests_queued") == 2

        running = asyncio.create_task(post("the first"))
        await until(lambda: fake.slots[0].busy, "the first request holds the slot")
        waiting = [asyncio.create_task(post(f"waiter {i}")) for i in range(2)]
        await until(two_queued, "two requests wait")
        proc.send_signal(signal.SIGTERM)
        for task in waiting:
            status, body, headers = await task
            assert status == 503
            assert body["error"]["code"] == "shutting_down"
            assert "Retry-After" in headers
        await asyncio.gather(running, return_exceptions=True)  # cut off, as at any stop
        assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_a_stream_cut_by_shutdown_ends_with_an_error_event(fakes: Any) -> None:
    """SIGTERM while a reply streams: the stream ends at once with an error event saying the
    proxy is shutting down, and a proper end of the body (it was cut mid-body after the grace
    period, which clients report as a broken connection, and logged as the client gone)."""
    fake = await fakes(n_slots=1, gen_s_per_token=0.05)
    async with _served(fake.url) as (proc, session, url):
        body = chat("a long story", max_tokens=400, stream=True)
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the reply streams
            proc.send_signal(signal.SIGTERM)
            rest = (await resp.read()).decode()  # (a cut body raised here)
        events = [line for line in rest.splitlines() if line.startswith("data: {")]
        assert json.loads(events[-1][6:])["error"]["code"] == "shutting_down"
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert proc.stderr is not None
        assert "outcome=shutdown" in (await proc.stderr.read()).decode()


async def test_no_backend_up_answers_503_after_the_wait(proxy: Any) -> None:
    client = await proxy(["http://127.0.0.1:9"], queue={"max_wait_seconds": 0.2})
    resp = await client.post("/v1/chat/completions", json=chat("hi"))
    assert resp.status == 503
    assert _is_openai_error(await resp.json())
    assert (await client.get("/readyz")).status == 503
    assert (await client.get("/healthz")).status == 200


async def test_connect_failure_retries_on_another_backend(fakes: Any, proxy: Any) -> None:
    fake = await fakes()
    dead = await fakes()
    client = await proxy([dead, fake], probe_loop=False)
    await dead.stop()  # probed ready at start, then gone: the next connect fails
    statuses = [(await client.post("/completion", json={"prompt": "x"})).status for _ in range(3)]
    assert statuses == [200, 200, 200]
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_upstream_errors_total", kind="connect") >= 1
    # down as /readyz tells it, not only once a probe (there is none here) finds it so
    label = dead.url.removeprefix("http://")
    assert metric(page, "llama_cache_proxy_backend_ready", backend=label) == 0


async def test_a_backend_that_cannot_be_reached_is_not_named_to_the_client(
    fakes: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Every backend gone between probes: the 502 says so, without the backend's address (an
    internal one; ``routing.address_headers`` keeps it from clients), which goes to the log."""
    backends = [await fakes(), await fakes()]
    client = await proxy(backends, probe_loop=False)
    for fake in backends:
        await fake.stop()
    with caplog.at_level(logging.WARNING):
        resp = await client.post("/completion", json={"prompt": "x"})
    text = await resp.text()
    assert resp.status == 502, text
    assert json.loads(text)["error"]["message"] == "backend unreachable"
    assert "127.0.0.1" not in text
    assert any(fake.url in record.getMessage() for fake in backends for record in caplog.records)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"], ids=["slot", "no-slot"])
async def test_a_request_whose_only_backend_restarts_is_served_once_it_is_back(
    fakes: Any, proxy: Any, path: str
) -> None:
    """The only backend refuses a connection (it restarts): the request is retried there once
    a probe finds it back, rather than kept off it until the queue's bound (a 503 after
    ``max_wait_seconds``: the retry avoided the one backend there is)."""
    fake = await fakes(n_slots=2)
    # (a fleet all down gets 503s after 3 probe rounds and a probe timeout: 5.3 s here, room
    # for the restart on a busy machine)
    client = await proxy(
        [fake],
        health={"interval_seconds": 0.1},
        queue={"max_wait_seconds": 30},
        timeouts={"probe_seconds": 5.0},
    )
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "content": "hi"}
    assert (await client.post(path, json=body)).status == 200
    await fake.stop()  # no probe has seen it go
    pending = asyncio.create_task(client.post(path, json=body))
    # the request's connection refused, or (the probes run every 0.1 s) a probe first: either
    # way the backend is down, the request waiting for it
    await until_down(client, fake)
    started = time.monotonic()
    await fakes(port=fake.port, n_slots=2)
    resp = await pending
    assert resp.status == 200, await resp.text()
    assert time.monotonic() - started < 10  # (the queue's bound is 30 s)


async def test_a_fleet_down_for_some_probe_rounds_answers_503_not_the_queues_bound(
    fakes: Any, proxy: Any
) -> None:
    """The only backend is gone for good: a request waits a few probe rounds for it to come
    back (a restarting server listens within them), then gets a 503, not one after the
    queue's bound (600 s by default); a request arriving later gets it at once."""
    fake = await fakes(n_slots=2)
    client = await proxy(
        [fake],
        health={"interval_seconds": 0.1},
        timeouts={"probe_seconds": 0.5},
        queue={"max_wait_seconds": 60},
    )
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    await fake.stop()
    started = time.monotonic()
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "no_backend"
    assert time.monotonic() - started < 10  # (the queue's bound: 60 s)
    started = time.monotonic()
    later = await client.post("/v1/chat/completions", json=body)
    assert (later.status, time.monotonic() - started < 0.5) == (503, True)


async def test_a_request_that_uses_no_slot_gets_a_503_from_a_fleet_down_for_good(
    fakes: Any, proxy: Any
) -> None:
    """As a request for a slot: ``/tokenize`` waits for a backend a few probe rounds, not the
    queue's bound, when every backend is down."""
    fake = await fakes(n_slots=1)
    client = await proxy(
        [fake],
        health={"interval_seconds": 0.1},
        timeouts={"probe_seconds": 0.5},
        queue={"max_wait_seconds": 60},
    )
    await until_ready(client)
    await fake.stop()
    started = time.monotonic()
    resp = await client.post("/tokenize", json={"content": "hi"})
    assert resp.status == 503
    assert time.monotonic() - started < 10  # (the queue's bound: 60 s)


async def test_loading_backend_holds_requests_until_ready(fakes: Any, proxy: Any) -> None:
    fake = await fakes()
    fake.loading = True
    client = await proxy([fake], admin_token=ADMIN)
    pending = asyncio.create_task(client.post("/completion", json={"prompt": "x"}))
    await until_metric(client, "llama_cache_proxy_requests_in_flight", lambda n: n == 2)

    async def seen_loading() -> bool:  # (a probe since the request arrived)
        return bool((await admin_view(client, fake))["phase"] == "loading")

    await until(seen_loading, "the proxy sees the backend loading")
    assert not pending.done()
    fake.loading = False
    assert (await pending).status == 200


async def test_upstream_timeout_is_504_and_slot_drains(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=1)
    client = await proxy([fake], timeouts={"read_seconds": 0.3})
    fake.hang_next()
    resp = await client.post("/completion", json={"prompt": "x"})
    assert resp.status == 504
    assert _is_openai_error(await resp.json())
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_upstream_errors_total", kind="timeout") == 1
    again = await client.post("/completion", json={"prompt": "x"})
    assert again.status == 200
    assert fake.violations == []


@pytest.mark.parametrize(
    ("stall", "status", "kind"), [(True, 504, "timeout"), (False, 502, "failed")]
)
async def test_a_body_that_breaks_off_is_a_gateway_error_and_counted(
    fakes: Any, proxy: Any, stall: bool, status: int, kind: str
) -> None:
    """A non-streamed answer whose body stops after its head: silent past the read bound
    (504) or cut off (502), as an OpenAI error, counted, and the slot drained."""
    fake = await fakes(n_slots=1)
    client = await proxy([fake], timeouts={"read_seconds": 0.3})
    fake.cut_next(stall=stall)
    resp = await client.post("/completion", json={"prompt": "x"})
    assert resp.status == status
    assert _is_openai_error(await resp.json())
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_upstream_errors_total", kind=kind) == 1
    assert (await client.post("/completion", json={"prompt": "x"})).status == 200
    assert fake.violations == []


async def test_upstream_error_status_passes_through_unchanged(fakes: Any, proxy: Any) -> None:
    fake = await fakes()
    client = await proxy([fake])
    fake.fail_next(500)
    resp = await client.post("/completion", json={"prompt": "x"})
    assert resp.status == 500
    assert (await resp.json())["error"]["message"] == "injected failure"
    assert "X-Proxy-Error" not in resp.headers


async def test_mid_stream_failure_ends_with_sse_error_event(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=1)
    client = await proxy([fake])
    fake.drop_next(after_chunks=2)
    resp = await client.post("/v1/chat/completions", json=chat("x", stream=True))
    assert resp.status == 200
    events = [e for e in (await resp.text()).split("\n\n") if e]
    assert len(events) == 3
    assert _is_openai_error(json.loads(events[-1].removeprefix("data: ")))
    page = await (await client.get("/metrics")).text()  # (after the status line: counted too)
    assert metric(page, "llama_cache_proxy_upstream_errors_total", kind="failed") == 1
    assert (await client.post("/completion", json={"prompt": "y"})).status == 200
    assert fake.violations == []


async def test_client_disconnect_cancels_upstream_and_frees_slot(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=1, gen_s_per_token=0.05, abort_release_s=0.3)
    client = await proxy([fake])
    url = str(client.make_url("/v1/chat/completions"))
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url, json=chat("x", stream=True, max_tokens=60))
        await resp.content.readany()
        resp.close()  # client goes away mid-stream
    # the next request must wait for the aborted slot, never be pinned onto it while busy
    again = await client.post("/v1/chat/completions", json=chat("y", max_tokens=2))
    assert again.status == 200
    assert fake.violations == []
    assert not fake.slots[0].busy
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_requests_in_flight") == 1  # the /metrics request


async def test_client_gone_before_headers_frees_the_slot_at_the_servers_check(
    fakes: Any, proxy: Any
) -> None:
    """A client that gives up before any header (llama.cpp's test_cancel_request): the
    backend cancels the task at its next connection check, which every task result (a drain
    poll's ``/slots`` answer too) postpones by a second; the proxy's polling leaves it one."""
    fake = await fakes(n_slots=1, gen_s_per_token=0.05, disconnect_poll_s=1.0)
    client = await proxy([fake])
    url = str(client.make_url("/completion"))
    async with aiohttp.ClientSession() as session:
        timeout = aiohttp.ClientTimeout(total=0.1)
        with pytest.raises(TimeoutError):
            await session.post(url, json={"prompt": "x", "n_predict": 200}, timeout=timeout)
    assert fake.slots[0].busy  # (10 s of generation had it not been cancelled)
    await until(lambda: not fake.slots[0].busy, "the server frees the slot", within=3.0)
    again = await client.post("/completion", json={"prompt": "y", "n_predict": 2})
    assert again.status == 200
    assert fake.violations == []
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_requests_total", endpoint="/completion") == 2
    assert metric(page, "llama_cache_proxy_requests_total", status="499") == 1
    assert metric(page, "llama_cache_proxy_requests_in_flight") == 1  # the /metrics request


async def test_client_gone_while_queued_leaves_the_queue(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=1, gen_s_per_token=0.02)
    client = await proxy([fake])
    first = asyncio.ensure_future(client.post("/completion", json={"prompt": "a", "n_predict": 40}))
    await until(lambda: fake.slots[0].busy, "the first holds the slot", within=3.0)
    url = str(client.make_url("/completion"))
    async with aiohttp.ClientSession() as session:
        timeout = aiohttp.ClientTimeout(total=0.2)
        with pytest.raises(TimeoutError):
            await session.post(url, json={"prompt": "b", "n_predict": 2}, timeout=timeout)
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_requests_queued") == 0
    assert metric(page, "llama_cache_proxy_requests_total", status="499") == 1
    assert (await first).status == 200
    assert (await client.post("/completion", json={"prompt": "c", "n_predict": 2})).status == 200
    assert [body["prompt"] for _, body, _ in fake.received] == ["a", "c"]  # never sent
    assert fake.violations == []


BAD_INPUTS = [
    pytest.param(b"{not json", 400, id="malformed-json"),
    pytest.param(b"[1, 2]", 400, id="not-an-object"),
    pytest.param(b"", 400, id="empty"),
    pytest.param(b"\xff\xfe{}", 400, id="invalid-utf8"),
    pytest.param(b'{"messages": "hi"}', 400, id="messages-not-array"),
    pytest.param(b'{"messages": [{"content": "x"}]}', 400, id="message-without-role"),
    pytest.param(
        b'{"messages": [{"role":"user","content":"x"}], "stream": "yes"}', 400, id="stream-not-bool"
    ),
    pytest.param(
        b'{"messages": [{"role":"user","content":"x"}], "max_tokens": "9"}',
        400,
        id="max-tokens-not-int",
    ),
    pytest.param(b'{"messages": [{"role":"user","content":"x"}], "n": 0}', 400, id="n-zero"),
    pytest.param(b"[" * 100000 + b"]" * 100000, 400, id="deep-nesting"),
    pytest.param(rb'{"messages": [{"role":"user","content":"\ud800"}]}', 400, id="lone-surrogate"),
]


@pytest.mark.parametrize(("raw", "status"), BAD_INPUTS)
async def test_bad_input_gets_openai_error(fakes: Any, proxy: Any, raw: bytes, status: int) -> None:
    fake = await fakes()
    client = await proxy([fake])
    resp = await client.post(
        "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}
    )
    assert resp.status == status
    assert _is_openai_error(await resp.json())
    assert fake.received == []


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd"])
async def test_an_encoded_body_is_refused_as_llama_server_refuses_it(
    fakes: Any, proxy: Any, encoding: str
) -> None:
    """llama-server takes no encoded body (415): the proxy answers so without decoding it."""
    fake = await fakes()
    client = await proxy([fake])
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    raw = gzip.compress(json.dumps(chat("hello", max_tokens=2)).encode())
    for data in (raw, b"not gzip"):
        resp = await client.post("/v1/chat/completions", data=data, headers=headers)
        assert resp.status == 415
        assert (await resp.json())["error"]["code"] == "unsupported_encoding"
        assert resp.headers["Connection"] == "close"
    assert fake.received == []


async def test_a_token_id_past_32_bits_is_a_400(fakes: Any, proxy: Any) -> None:
    fake = await fakes()
    client = await proxy([fake])
    resp = await client.post("/completion", json={"prompt": [1, 2**40], "n_predict": 1})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "prompt"
    assert fake.received == []


async def test_oversized_body_is_413(fakes: Any, proxy: Any) -> None:
    client = await proxy([await fakes()], max_body_bytes=4096)
    resp = await client.post("/v1/chat/completions", json=chat("x" * 10000))
    assert resp.status == 413
    assert _is_openai_error(await resp.json())


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/nope", 404),
        ("POST", "/slots/0?action=save", 403),
        ("POST", "/slots/0?action=erase", 403),
        ("POST", "/../nope", 404),
        ("PUT", "/v1/chat/completions", 404),  # a method the path does not take, as the server
    ],
)
async def test_unknown_paths_and_slot_actions_are_not_forwarded(
    fakes: Any, proxy: Any, method: str, path: str, status: int
) -> None:
    fake = await fakes()
    client = await proxy([fake])
    resp = await client.request(method, path)
    assert resp.status == status
    assert _is_openai_error(await resp.json())
    assert fake.received == []


@pytest.mark.parametrize("path", ["/nope", "/", "/v1/chat/completions"])
async def test_a_get_of_a_path_the_proxy_does_not_serve_is_the_backends_answer(
    fakes: Any, proxy: Any, path: str
) -> None:
    """llama-server serves its web UI and ``--path`` static files on any GET path, and
    answers a path it does not serve with its own 404: so does the proxy, through it."""
    fake = await fakes()
    client = await proxy([fake])
    resp = await client.get(path)
    async with aiohttp.ClientSession() as session, session.get(fake.url + path) as direct:
        assert (resp.status, await resp.read()) == (direct.status, await direct.read())


async def _served_then_gone(fakes: Any, proxy: Any) -> tuple[Any, Any, dict[str, Any]]:
    """A proxy whose backend (a fake of two slots) served one turn of a conversation, its
    task ids read by a probe, then went away: (client, fake, the next turn)."""
    fake = await fakes(n_slots=2)
    client = await proxy([fake], health={"interval_seconds": 0.05})
    first = chat("a conversation long enough to be worth its slot " * 8, max_tokens=4)
    resp = await client.post("/v1/chat/completions", json=first)
    assert resp.status == 200
    reply = (await resp.json())["choices"][0]["message"]["content"]
    backend = client.server.app[SCHEDULER].fleet.backends[0]
    await until(lambda: backend.max_task_id >= 0, "a probe reads the task ids")
    await fake.stop()
    await until_down(client, fake)
    turn = {
        **first,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "and then?"},
        ],
    }
    return client, fake, turn


async def test_backend_restart_invalidates_slot_state(fakes: Any, proxy: Any) -> None:
    client, fake, turn = await _served_then_gone(fakes, proxy)
    assert (await client.post("/completion", json={"prompt": "a"})).status == 503
    await fakes(port=fake.port, n_slots=2)  # a new process: its task ids start again
    await until_ready(client)
    resp = await client.post("/v1/chat/completions", json=turn)
    assert resp.status == 200
    assert resp.headers["X-Cache-Predicted-Tokens"] == "0"
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_backend_restarts_total") == 1


async def test_a_backend_back_from_an_outage_keeps_its_slot_state(fakes: Any, proxy: Any) -> None:
    """Unreachable for a while (a network cut, a stopped process), then back as it was: the
    same task ids, the same KV. The conversation's next turn finds its slot."""
    client, fake, turn = await _served_then_gone(fakes, proxy)
    await fake.start(fake.port)  # the same server, its slots as they were
    await until_ready(client)
    resp = await client.post("/v1/chat/completions", json=turn)
    assert resp.status == 200
    assert int(resp.headers["X-Cache-Predicted-Tokens"]) > 0
    assert (await resp.json())["timings"]["cache_n"] > 0
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_backend_restarts_total") == 0


async def test_backend_that_accepts_and_never_answers_is_marked_down(
    fakes: Any, proxy: Any
) -> None:
    writers: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)  # accept, read nothing, answer nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    fake = await fakes(n_slots=1)
    try:
        client = await proxy(
            [f"http://127.0.0.1:{port}", fake],
            timeouts={"probe_seconds": 0.3, "read_seconds": 0.5},
            health={"interval_seconds": 0.1},
        )
        page = await (await client.get("/metrics")).text()
        assert metric(page, "llama_cache_proxy_backend_ready", backend=f"127.0.0.1:{port}") == 0
        started = asyncio.get_running_loop().time()
        for _ in range(3):  # bounded: served by the healthy backend, never by the silent one
            resp = await client.post("/completion", json={"prompt": "x"})
            assert resp.status == 200
            assert resp.headers["X-Cache-Backend"] == f"127.0.0.1:{fake.port}"
        assert asyncio.get_running_loop().time() - started < 5
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


async def test_server_timing_and_the_wait_histogram_show_the_time_spent_waiting_for_a_slot(
    fakes: Any, proxy: Any
) -> None:
    fake = await fakes(n_slots=1, gen_s_per_token=0.02)
    client = await proxy([fake])
    body = chat("the first holds the only slot for about 200 ms", max_tokens=10)
    first = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    await until(lambda: fake.slots[0].busy, "the first holds the only slot", every=0.005)
    second = await client.post("/v1/chat/completions", json=chat("another", max_tokens=1))
    assert second.status == 200
    waited = server_timing(second.headers["Server-Timing"])
    immediate = server_timing((await first).headers["Server-Timing"])
    assert waited.keys() == immediate.keys() == {"route", "queue"}
    assert waited["queue"] >= 50
    assert immediate["queue"] < waited["queue"]
    page = await (await client.get("/metrics")).text()
    name = "llama_cache_proxy_slot_wait_seconds"
    assert metric(page, name + "_count", endpoint="/v1/chat/completions") == 2
    assert metric(page, name + "_sum") >= (waited["queue"] + immediate["queue"]) / 1000 - 0.001
    assert metric(page, name + "_bucket", le="0.025") == 1  # the first did not wait


async def test_no_server_timing_without_route_headers(fakes: Any, proxy: Any) -> None:
    client = await proxy([await fakes()], routing={"route_headers": False})
    resp = await client.post("/v1/chat/completions", json=chat("hi"))
    assert resp.status == 200
    assert "Server-Timing" not in resp.headers
    assert "X-Cache-Route" not in resp.headers


class _SlowLeases(InMemoryStateStore):
    """A shared store whose lease requests answer only once ``answer`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.asked, self.answer = asyncio.Event(), asyncio.Event()

    async def acquire_lease(self, ref: Any, owner: str, ttl: float, now: float) -> bool:
        self.asked.set()
        await self.answer.wait()
        return await super().acquire_lease(ref, owner, ttl, now)


async def test_a_client_gone_while_its_slot_lease_is_asked_for_gives_the_slot_back(
    fakes: Any, aiohttp_client: Any
) -> None:
    """With shared state, a slot is leased after it is chosen. A client that leaves while
    the store has not yet answered cancels its request there: nothing was sent, and the
    slot is free for the next request (it stayed busy for good before)."""
    fake = await fakes(n_slots=1)
    store, port = _SlowLeases(), free_port()
    secret = {"secret": REPLICA_SECRET}
    settings = make_settings(
        [fake.url], listen=f"127.0.0.1:{port}", redis_url="redis://127.0.0.1:1", replicas=secret
    )
    app = create_app(settings, registry=CollectorRegistry(), store=store)
    client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True, "port": port})
    url = str(client.make_url("/completion"))
    async with aiohttp.ClientSession() as session:
        gone = asyncio.ensure_future(session.post(url, json={"prompt": "a", "n_predict": 2}))
        await until(store.asked.is_set, "the slot's lease is asked for")
        gone.cancel()  # the client leaves
        await asyncio.gather(gone, return_exceptions=True)
    store.answer.set()
    again = await client.post("/completion", json={"prompt": "b", "n_predict": 2})
    assert again.status == 200, await again.text()
    assert [body["prompt"] for _, body, _ in fake.received] == ["b"]


class _PropsBlip(FakeLlamaServer):
    """``/props`` answers 503 ``failing`` times while ``/health`` says ok."""

    failing = 0

    async def props(self, request: web.Request) -> web.Response:
        if self.failing:
            self.failing -= 1
            return web.json_response({"error": {"message": "blip"}}, status=503)
        return await super().props(request)


async def test_a_props_error_from_a_healthy_backend_leaves_its_slot_table_as_it_was(
    proxy: Any,
) -> None:
    """A ``/props`` error body counts no slot: read as one, it emptied the slot table (under a
    request in flight, which then failed with a 500 after its answer had come), and no
    request was placed until the next probe."""
    fake = _PropsBlip(n_slots=2, prompt_s_per_token=0.002)
    await fake.start()
    try:
        client = await proxy([fake], health={"interval_seconds": 60})
        body = {"messages": [{"role": "user", "content": "hello " * 200}], "max_tokens": 4}
        fake.failing = 1  # the next /props read (the drain poll after a request) answers 503
        first = await client.post("/v1/chat/completions", json=body)
        assert first.status == 200, await first.text()
        await until(lambda: fake.failing == 0, "a probe read /props")
        again = await client.post("/v1/chat/completions", json=body)  # (no probe for 60 s)
        assert again.status == 200, await again.text()
    finally:
        await fake.stop()


async def test_a_healthy_backend_whose_slots_cannot_be_read_says_why_once(
    proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``/health`` answers ok but ``/props`` an error, probe after probe (a gateway in front
    of the server, say): the backend stays not ready, and the log says why, once, rather than
    nothing at all."""
    fake = _PropsBlip(n_slots=2)
    fake.failing = 10**6
    await fake.start()
    try:
        with caplog.at_level(logging.WARNING, logger="proxy.backends.health"):
            client = await proxy([fake], health={"interval_seconds": 0.05})
            await until(lambda: fake.failing <= 10**6 - 4, "four probes read /props")
        assert (await client.get("/readyz")).status == 503
        said = [r.getMessage() for r in caplog.records if "slots not read" in r.getMessage()]
        assert said == [
            f"backend={fake.url.removeprefix('http://')} healthy, its slots not read "
            "(/props answered 503): not ready until they can"
        ]
    finally:
        await fake.stop()


async def test_a_body_nested_as_deep_as_the_decoder_takes_is_a_400_not_a_500(
    fakes: Any, proxy: Any
) -> None:
    """Nesting the decoder accepts can still be too deep for re-encoding (the prompt's
    fingerprint, the forwarded body): a clear 400 then, never an internal error."""
    fake = await fakes(n_slots=1)
    client = await proxy([fake])
    for depth in range(850, 1050):
        schema = '{"a":' * depth + "1" + "}" * depth
        tools = '[{"type":"function","function":{"name":"f","parameters":' + schema + "}}]"
        raw = '{"messages":[{"role":"user","content":"x"}],"tools":' + tools + "}"
        resp = await client.post(
            "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}
        )
        assert resp.status in (200, 400), (depth, resp.status, await resp.text())


async def test_an_id_slot_of_minus_one_is_any_slot_as_for_the_server(
    fakes: Any, proxy: Any
) -> None:
    fake = await fakes(n_slots=2)
    client = await proxy([fake], routing={"honor_client_id_slot": True})
    resp = await client.post("/completion", json={"prompt": "x", "n_predict": 1, "id_slot": -1})
    assert resp.status == 200, await resp.text()


async def test_a_backend_that_is_not_llama_server_is_down_and_still_probed(
    proxy: Any, aiohttp_server: Any
) -> None:
    """An answer not shaped as llama-server's (``/props`` a JSON list) is a backend down, not
    an error that ends the probing for good."""
    seen: list[str] = []

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def props(request: web.Request) -> web.Response:
        seen.append("props")
        return web.json_response([1, 2])

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/props", props)
    other = await aiohttp_server(app)
    client = await proxy([str(other.make_url("")).rstrip("/")], health={"interval_seconds": 0.05})
    await until(lambda: len(seen) >= 3, "the probing goes on")
    assert (await client.get("/readyz")).status == 503


async def test_a_backend_first_seen_after_the_proxy_started_is_no_restart(
    fakes: Any, proxy: Any
) -> None:
    port = free_port()
    client = await proxy([f"http://127.0.0.1:{port}"], health={"interval_seconds": 0.05})
    await until_metric(client, "llama_cache_proxy_backend_ready", lambda v: v == 0)
    await fakes(port=port)
    await until_ready(client)
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_backend_restarts_total") == 0


async def test_an_aborted_slot_of_a_backend_whose_slots_cannot_be_read_comes_back(
    fakes: Any, proxy: Any
) -> None:
    """A backend behind an API key the proxy is not given (clients' keys pass through): its
    ``/slots`` cannot be read, so no probe shows an aborted request's slot idle again. Once
    the drain's bound passes, the slot is taken for idle (it stayed someone else's for good,
    and the backend, modelled as one slot, answered nothing but 503s after one abort)."""
    fake = await fakes(n_slots=1, gen_s_per_token=0.05, abort_release_s=0.2)
    fake.api_key = "backend-key"
    client = await proxy(
        [fake],
        health={"interval_seconds": 0.1, "drain_max_seconds": 0.5},
        queue={"max_wait_seconds": 5.0},
    )
    key = {"Authorization": "Bearer backend-key"}
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 60}
    async with aiohttp.ClientSession() as session:
        url = str(client.make_url("/v1/chat/completions"))
        resp = await session.post(url, json=body, headers=key)
        await resp.content.readany()
        resp.close()  # the client leaves mid-stream: the slot drains
    await until_metric(client, "llama_cache_proxy_slots", lambda n: n == 1, phase="idle")
    short = {"messages": [{"role": "user", "content": "y"}], "max_tokens": 2}
    for _ in range(2):
        again = await client.post("/v1/chat/completions", json=short, headers=key)
        assert again.status == 200, await again.text()
    assert fake.violations == []


class _SlowProps(FakeLlamaServer):
    """A server whose ``/props`` answers late (a busy host): ``/health`` and completions not."""

    delay = 0.0
    asked = 0

    async def props(self, request: web.Request) -> web.Response:
        self.asked += 1
        await asyncio.sleep(self.delay)
        return await super().props(request)


async def test_a_backend_slow_to_tell_its_props_is_not_held_down(proxy: Any) -> None:
    """``/health`` answers, ``/props`` later than the probe timeout: healthy, its state as it
    was (it was held down on every probe, so never used again)."""
    fake = _SlowProps(n_slots=2)
    await fake.start()
    try:
        client = await proxy(
            [fake], health={"interval_seconds": 0.1}, timeouts={"probe_seconds": 0.3}
        )
        short = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
        assert (await client.post("/v1/chat/completions", json=short)).status == 200
        fake.delay = 0.6
        asked = fake.asked
        await until(lambda: fake.asked >= asked + 3, "three slow probes", within=10)
        assert (await client.get("/readyz")).status == 200
        assert (await client.post("/v1/chat/completions", json=short)).status == 200
    finally:
        await fake.stop()


@pytest.mark.parametrize("backends", [1, 2])
async def test_a_backend_found_loading_by_a_request_is_waited_for_or_passed_over(
    fakes: Any, proxy: Any, backends: int
) -> None:
    """A backend restarted since its last probe answers the request 503 "Loading model", as
    llama-server does while it loads: nothing ran. The request goes to another backend, or,
    with none, waits until the load ends; the client never sees that 503 (it was relayed)."""
    fleet = [await fakes(n_slots=1) for _ in range(backends)]
    client = await proxy(fleet, probe_loop=False)
    body = {"messages": [{"role": "user", "content": "one " * 40}], "max_tokens": 2}
    first = await client.post("/v1/chat/completions", json=body)
    assert first.status == 200
    served = next(f for f in fleet if f.url.endswith(first.headers["X-Cache-Backend"]))
    await served.stop()
    fresh = await fakes(port=served.port, n_slots=1)
    fresh.loading = True  # no probe has seen the restart
    pending = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    await until_metric(
        client, "llama_cache_proxy_upstream_errors_total", lambda n: n == 1, kind="loading"
    )
    if backends == 1:
        fresh.loading = False
        await client.server.app[PROBER].probe_all()  # the load ends: a probe finds it ready
    resp = await pending
    assert resp.status == 200, await resp.text()
    assert (resp.headers["X-Cache-Backend"] == first.headers["X-Cache-Backend"]) == (backends == 1)

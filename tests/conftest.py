"""Shared fixtures: fake llama-servers, a settings factory, and the proxy under test."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config.settings import Settings
from testbed.fake_llama import FakeLlamaServer
from testbed.stack import RedisServer, free_port

REPLICA_SECRET = "test replicas' shared secret"


def make_settings(urls: list[str | dict[str, Any]], **over: Any) -> Settings:
    """Backends' reuse rule is configured (``prefix``) unless a test sets it: the probe of an
    ``auto`` backend would add its own requests to what the fakes record."""
    data: dict[str, Any] = {
        "backends": [{"kv_reuse": "prefix", **_backend(u)} for u in urls],
        "health": {"interval_seconds": 0.2, "drain_poll_seconds": 0.05},
        "queue": {"max_wait_seconds": 5.0},
        "timeouts": {"connect_seconds": 1.0, "read_seconds": 5.0, "probe_seconds": 1.0},
        "routing": {"address_headers": True},  # tests read X-Cache-Backend (opt-in)
    }
    for key, value in over.items():
        if isinstance(value, dict):
            data[key] = {**data.get(key, {}), **value}
        else:
            data[key] = value
    return Settings.model_validate(data)


def _backend(url: str | dict[str, Any]) -> dict[str, Any]:
    return {"url": url} if isinstance(url, str) else url


@pytest.fixture
async def fakes() -> AsyncIterator[Callable[..., Awaitable[FakeLlamaServer]]]:
    started: list[FakeLlamaServer] = []

    async def start(port: int = 0, **kwargs: Any) -> FakeLlamaServer:
        server = FakeLlamaServer(**kwargs)
        await server.start(port)
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()


ProxyFactory = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
def proxy(aiohttp_client: Any) -> ProxyFactory:
    """``await proxy([fake, ...], **settings_overrides)`` -> a client of a running proxy."""

    async def start(
        backends: list[Any],
        *,
        probe_loop: bool = True,
        wall: Callable[[], float] = time.time,
        **over: Any,
    ) -> TestClient[Any, Any]:
        urls = [b if isinstance(b, str | dict) else b.url for b in backends]
        if over.get("redis_url") and "replicas" not in over:  # replicas trust one another
            over["replicas"] = {"secret": REPLICA_SECRET}
        port = free_port()  # listen names it: replicas advertise it to their peers
        settings = make_settings(urls, listen=f"127.0.0.1:{port}", **over)
        app = create_app(settings, registry=CollectorRegistry(), probe_loop=probe_loop, wall=wall)
        client: TestClient[Any, Any] = await aiohttp_client(
            app, server_kwargs={"handler_cancellation": True, "port": port}
        )
        return client

    return start


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], **extra}


async def events_to_done(resp: Any) -> list[dict[str, Any]]:
    """The JSON events of a stream, read as OpenAI SDKs and OpenClaw read it: up to
    ``data: [DONE]`` and no further (the end of the chunked body is not awaited)."""
    events: list[dict[str, Any]] = []
    async for line in resp.content:
        if line.startswith(b"data: [DONE]"):
            return events
        if line.startswith(b"data: {"):
            events.append(json.loads(line[6:]))
    raise AssertionError("the stream ended without [DONE]")


def delta_text(events: list[dict[str, Any]]) -> str:
    """The assistant text of chat stream events."""
    return "".join(
        (e["choices"][0]["delta"].get("content") or "") for e in events if e.get("choices")
    )


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server (Debian package) on a free port, stopped at teardown."""
    server = RedisServer().start()
    yield server
    server.stop()

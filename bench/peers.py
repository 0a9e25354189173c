"""Peer routers from PyPI, each in its own virtual environment under ``bench/.peers``.

``python -m bench.peers install`` creates the environments (sglang-router, smg,
vllm-router); ``available_peers()`` returns a context manager per installed router that
starts it with its cache-aware policy in front of the given backend URLs and yields its URL.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import aiohttp

from testbed.stack import free_port, wait_http

HOME = Path(__file__).parent / ".peers"
# sglang-router pinned: the overhead tables in docs/benchmarks.md compare against 0.3.2
PACKAGES = {"sglang-router": "sglang-router==0.3.2", "smg": "smg", "vllm-router": "vllm-router"}


def _bin(name: str, exe: str) -> Path:
    return HOME / name / "bin" / exe


# Each router's session policy (a session id sent as a header pins a session to a worker):
# sglang-router and smg read X-SMG-Routing-Key (``manual``: a sticky key -> worker map,
# new keys to the least loaded worker), vllm-router reads X-Session-Id
# (``sticky_least_loaded``: new sessions to the worker with the fewest active sessions).
SESSION_POLICIES = {
    "sglang-router": "manual",
    "smg": "manual",
    "vllm-router": "sticky_least_loaded",
}
SESSION_HEADERS = ("X-SMG-Routing-Key", "X-Session-Id")


def _command(name: str, urls: list[str], port: int, policy: str) -> list[str]:
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        policy,
    ]
    if name == "sglang-router":
        return [str(_bin(name, "python")), "-m", "sglang_router.launch_router", *common]
    if name == "smg":
        return [str(_bin(name, "smg")), "launch", *common, "--model-alias", "local=fake-model"]
    return [str(_bin(name, "vllm-router")), *common]


async def _until_workers(url: str) -> None:
    """Routers register workers asynchronously: wait until one answers a completion."""
    body = {"model": "fake-model", "prompt": "warm up", "max_tokens": 1}
    async with aiohttp.ClientSession() as session:
        for _ in range(300):
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"router at {url} never routed a request")


def install() -> None:
    for name, package in PACKAGES.items():
        env = HOME / name
        if not env.exists():
            subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        subprocess.run([str(env / "bin" / "pip"), "install", "-q", package], check=False)


def _installed(name: str) -> bool:
    exe = {"sglang-router": "python", "smg": "smg", "vllm-router": "vllm-router"}[name]
    return _bin(name, exe).exists()


def available_peers() -> dict[str, Callable[[list[str]], AbstractAsyncContextManager[str]]]:
    """Per installed router, its cache-aware policy (``name``) and its session policy
    (``name:policy``; the replay sends session ids to those)."""

    def starter(
        name: str, policy: str = "cache_aware"
    ) -> Callable[[list[str]], AbstractAsyncContextManager[str]]:
        @asynccontextmanager
        async def run(urls: list[str]) -> AsyncIterator[str]:
            port = free_port()
            log = open(HOME / f"{name}.log", "ab")  # noqa: SIM115, ASYNC230 (bench set-up)
            proc = subprocess.Popen(  # noqa: ASYNC220 (started once per policy run)
                _command(name, urls, port, policy), stdout=log, stderr=log
            )
            try:
                url = f"http://127.0.0.1:{port}"
                await asyncio.to_thread(wait_http, url + "/health", 60, proc)
                await _until_workers(url)
                yield url
            finally:
                proc.terminate()
                proc.wait(10)
                log.close()

        return run

    installed = [name for name in PACKAGES if _installed(name)]
    peers = {name: starter(name) for name in installed}
    for name in installed:
        peers[f"{name}:{SESSION_POLICIES[name]}"] = starter(name, SESSION_POLICIES[name])
    return peers


if __name__ == "__main__":
    install()

"""The proxy as its own process (``python -m proxy serve``), for ``bench.replay --process``.

In-process (``bench.inproc``) the proxy shares the benchmark's event loop with every fake
backend and the client, so its routing CPU time delays the fakes' replies too; the peer
routers run as separate processes. Latency is comparable only with ours out of process.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp

from bench.inproc import with_address_headers
from proxy.config.settings import Settings
from testbed.stack import free_port


@asynccontextmanager
async def serve_process(
    settings: Settings, ready_within: float = 60.0, source: str | None = None
) -> AsyncIterator[str]:
    """``async with serve_process(settings) as url``: the proxy's base URL while it runs;
    ``source``: run the proxy of that checkout instead (another commit, side by side)."""
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(with_address_headers(settings).model_dump(mode="json"), f)  # JSON is YAML
    command = [sys.executable, "-m", "proxy", "serve", "--config", f.name]
    env = None if source is None else {**os.environ, "PYTHONPATH": source}
    proc = await asyncio.create_subprocess_exec(
        *command, "--listen", f"127.0.0.1:{port}", env=env, cwd=source
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await _until_ready(url, proc, ready_within)
        yield url
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        os.remove(f.name)


async def _until_ready(url: str, proc: asyncio.subprocess.Process, within: float) -> None:
    """Polled without blocking the loop: the proxy is ready only once it has probed the fakes,
    which answer from this process's loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"proxy exited with {proc.returncode}")
            try:
                async with session.get(url + "/readyz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} not ready in {within}s")

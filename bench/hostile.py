"""Hostile bodies: event-loop lag and memory while they arrive.

Processes on loopback: one fake llama-server (4 slots) and the proxy (``llama-cache-proxy
serve``, default settings: a 32 MiB body limit). A probe client asks ``/healthz`` every
10 ms throughout (its latency is the proxy's event-loop lag plus a loopback round trip).
Phases, each reporting the probe's latency p50 / p99 / max and the proxy's RSS (``VmRSS``):

- idle: the probe alone (the baseline RSS);
- distinct 1 MiB messages: ``--messages`` chat requests (4 at a time), each one user
  message of 1 MiB of its own text (the fake answers them 400, past its context: the proxy
  fingerprints each before forwarding it);
- hostile bodies, each twice, one at a time: a 20 MB chat body of 300k small messages, a
  30 MiB raw ``/completion`` prompt, a 1 MiB gzip body that inflates to 1 GiB (status and
  seconds per body reported).

    python -m bench.hostile [--messages 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import aiohttp

from bench.overhead import _process
from bench.results_io import print_markdown, save
from testbed.stack import fake_command, free_port, wait_http

MIB = 1024 * 1024


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def probe(session: aiohttp.ClientSession, url: str, out: list[float]) -> None:
    while True:
        started = time.perf_counter()
        async with session.get(url + "/healthz") as resp:
            await resp.read()
        out.append(time.perf_counter() - started)
        await asyncio.sleep(0.01)


def bomb() -> bytes:
    """1 GiB of zeros, gzip-compressed (about 1 MiB)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = b"0" * MIB
    return b"".join([*(packer.compress(chunk) for _ in range(1024)), packer.flush()])


def hostile() -> list[tuple[str, str, bytes, dict[str, str]]]:
    messages = [{"role": "user", "content": f"m{i} hi there"} for i in range(300_000)]
    chat = json.dumps({"messages": messages, "max_tokens": 1}).encode()
    words = " ".join(f"w{i % 5000}" for i in range(5 * MIB))[: 30 * MIB - 100]
    prompt = json.dumps({"prompt": words, "n_predict": 1}).encode()
    plain = {"Content-Type": "application/json"}
    encoded = {**plain, "Content-Encoding": "gzip"}
    return [
        ("20 MB body, 300k messages", "/v1/chat/completions", chat, plain),
        ("30 MiB prompt", "/completion", prompt, plain),
        ("gzip bomb (1 MiB -> 1 GiB)", "/v1/chat/completions", bomb(), encoded),
    ]


async def phase(session: aiohttp.ClientSession, url: str, work: Any) -> dict[str, Any]:
    lags: list[float] = []
    task = asyncio.create_task(probe(session, url, lags))
    started = time.perf_counter()
    detail = await work()
    seconds = time.perf_counter() - started
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    ms = sorted(x * 1000 for x in lags)
    p99 = statistics.quantiles(ms, n=100)[98] if len(ms) > 1 else ms[0]
    return {"seconds": seconds, "probes": len(ms), "p50_ms": statistics.median(ms),
            "p99_ms": p99, "max_ms": ms[-1], "detail": detail}  # fmt: skip


async def measure(url: str, pid: int, count: int) -> list[dict[str, Any]]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def idle() -> str:
            await asyncio.sleep(3)
            return ""

        async def distinct() -> str:
            statuses: dict[int, int] = {}
            queue = iter(range(count))

            async def client() -> None:
                for i in queue:
                    text = f"{i:06d} " + "lorem ipsum dolor sit amet " * (MIB // 27)
                    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
                    async with session.post(url + "/v1/chat/completions", json=body) as resp:
                        await resp.read()
                        statuses[resp.status] = statuses.get(resp.status, 0) + 1

            await asyncio.gather(*(client() for _ in range(4)))
            return " ".join(f"{n}x{s}" for s, n in sorted(statuses.items()))

        async def bodies() -> str:
            done = []
            for name, path, data, headers in hostile() * 2:
                started = time.perf_counter()
                async with session.post(url + path, data=data, headers=headers) as resp:
                    await resp.read()
                done.append(f"{name}: {resp.status} in {time.perf_counter() - started:.2f} s")
            return "; ".join(done[:3])

        rows = []
        for name, work in (("idle", idle), (f"{count} distinct 1 MiB messages", distinct),
                           ("hostile bodies x2", bodies)):  # fmt: skip
            row = {"phase": name, **await phase(session, url, work), "rss_mib": rss_mib(pid)}
            print(json.dumps(row))
            rows.append(row)
        return rows


def run(count: int) -> list[dict[str, Any]]:
    port, proxy_port = free_port(), free_port()
    env = {**os.environ, "LLAMA_CACHE_PROXY_LOG_LEVEL": "WARNING"}
    with contextlib.ExitStack() as stack:
        fake = fake_command(port, 4)
        stack.enter_context(_process(fake, f"http://127.0.0.1:{port}/health"))
        args = [sys.executable, "-m", "proxy", "serve", "--listen", f"127.0.0.1:{proxy_port}"]
        args += ["--backend", f"http://127.0.0.1:{port}"]
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(proc.wait, 10)
        stack.callback(proc.terminate)
        url = f"http://127.0.0.1:{proxy_port}"
        wait_http(url + "/readyz", 30, proc)
        return asyncio.run(measure(url, proc.pid, count))


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n/healthz latency every 10 ms while each phase runs ({platform.machine()})")
    header = ("phase", "seconds", "probes", "p50 ms", "p99 ms", "max ms", "RSS MiB", "detail")
    print_markdown(
        header,
        (
            (r["phase"], f"{r['seconds']:.1f}", r["probes"], f"{r['p50_ms']:.1f}",
             f"{r['p99_ms']:.1f}", f"{r['max_ms']:.1f}", f"{r['rss_mib']:.0f}", r["detail"])
            for r in rows
        ),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=1000)
    args = parser.parse_args()
    rows = run(args.messages)
    save("hostile", rows)
    print_table(rows)


if __name__ == "__main__":
    main()

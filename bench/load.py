"""Overload: ramp concurrent streams past the fleet's slots x 4 and check what holds.

Processes on loopback: two fake llama-servers (4 slots each, 20 ms per generated token),
the proxy (``llama-cache-proxy serve``; queue bound ``slots x 2`` waiting requests, 5 s wait
limit) and this load generator. Each level runs closed-loop streaming clients for a fixed
time; every request carries a unique marker in its prompt and the streamed text is checked
against the reply the fake derives from exactly that prompt, so a reply delivered twice or
to the wrong client is caught. Reported per level: completed, 503s (each must carry
``Retry-After``), other failures, mismatched replies, time to first byte p50/p99 through the
proxy and direct to a fake at the same concurrency, and the proxy's peak RSS (``VmHWM``).

    python -m bench.load [--seconds 10]
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
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from bench.overhead import _process
from bench.results_io import print_markdown, save
from testbed.fake_llama import render_chat, reply_words, tokenize
from testbed.stack import free_port, wait_http

SLOTS_PER_BACKEND, BACKENDS, REPLY = 4, 2, 8


def body(marker: str) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": "You are a load-test agent. " * 20},
            {"role": "user", "content": f"request {marker}"},
        ],
        "max_tokens": REPLY,
        "stream": True,
    }


def expected(request: dict[str, Any]) -> str:
    return "".join(reply_words(tokenize(render_chat(request)), REPLY))


async def one(session: aiohttp.ClientSession, url: str, out: dict[str, Any]) -> None:
    request = body(uuid.uuid4().hex)
    started = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=request) as resp:
            if resp.status == 503:
                out["503"] += 1
                out["retry_after_missing"] += "Retry-After" not in resp.headers
                await resp.read()
                return
            if resp.status != 200:
                out["failed"] += 1
                await resp.read()
                return
            text, first = [], None
            async for line in resp.content:
                if first is None:
                    first = time.perf_counter() - started
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices", []):
                        text.append((choice.get("delta") or {}).get("content") or "")
            out["ttfb"].append(first or 0.0)
            out["ok"] += 1
            out["mismatch"] += "".join(text) != expected(request)
    except (TimeoutError, aiohttp.ClientError):
        out["failed"] += 1


async def level(url: str, concurrency: int, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ok": 0, "503": 0, "failed": 0, "mismatch": 0, "retry_after_missing": 0, "ttfb": []
    }  # fmt: skip
    deadline = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:

        async def client() -> None:
            while time.monotonic() < deadline:
                await one(s, url, out)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return out


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(values: list[float], q: int) -> float:
    """The ``q``-th percentile of ``values`` (seconds), in milliseconds."""
    if not values:
        return 0.0
    return (statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]) * 1000


async def measure(
    proxy_url: str, direct_url: str, pid: int, seconds: float
) -> list[dict[str, Any]]:
    slots = SLOTS_PER_BACKEND * BACKENDS
    rows = []
    for factor in (1, 2, 4, 8):
        concurrency = slots * factor
        through = await level(proxy_url, concurrency, seconds)
        direct = await level(direct_url, min(concurrency, SLOTS_PER_BACKEND), seconds / 2)
        row = {
            "concurrency": concurrency,
            **{k: through[k] for k in ("ok", "503", "failed", "mismatch", "retry_after_missing")},
            "ttfb_p50_ms": pct(through["ttfb"], 50),
            "ttfb_p99_ms": pct(through["ttfb"], 99),
            "direct_ttfb_p99_ms": pct(direct["ttfb"], 99),
            "peak_rss_mib": peak_rss_mib(pid),
        }
        rows.append(row)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}))
    return rows


def run(seconds: float) -> list[dict[str, Any]]:
    slots = SLOTS_PER_BACKEND * BACKENDS
    ports = [free_port() for _ in range(BACKENDS)]
    proxy_port = free_port()
    fake = [sys.executable, "-m", "testbed.fake_llama", "--slots", str(SLOTS_PER_BACKEND)]
    env = {
        **os.environ,
        "LLAMA_CACHE_PROXY_QUEUE__MAX_WAITING": str(slots * 2),
        "LLAMA_CACHE_PROXY_QUEUE__MAX_WAIT_SECONDS": "5",
        "LLAMA_CACHE_PROXY_LOG_LEVEL": "WARNING",
    }
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    with contextlib.ExitStack() as stack:
        for port, url in zip(ports, urls, strict=True):
            args = [*fake, "--port", str(port), "--gen-ms", "20"]
            stack.enter_context(_process(args, url + "/health"))
        args = [sys.executable, "-m", "proxy", "serve", "--listen", f"127.0.0.1:{proxy_port}"]
        for url in urls:
            args += ["--backend", url]
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(proc.wait, 10)
        stack.callback(proc.terminate)
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        wait_http(proxy_url + "/readyz", 30, proc)
        return asyncio.run(measure(proxy_url, urls[0], proc.pid, seconds))


def print_table(rows: list[dict[str, Any]]) -> None:
    slots = SLOTS_PER_BACKEND * BACKENDS
    print(
        f"\n{BACKENDS} fake backends x {SLOTS_PER_BACKEND} slots ({slots} slots), queue bound "
        f"{slots * 2}, wait limit 5 s, {REPLY}-token streams at 20 ms/token ({platform.machine()})"
    )
    header = (
        "streams",
        "completed",
        "503",
        "failed",
        "wrong reply",
        "TTFB p50 ms",
        "TTFB p99 ms",
        "direct p99 ms (slots busy)",
        "proxy peak RSS MiB",
    )
    print_markdown(
        header,
        (
            (
                r["concurrency"],
                r["ok"],
                r["503"],
                r["failed"],
                r["mismatch"],
                f"{r['ttfb_p50_ms']:.1f}",
                f"{r['ttfb_p99_ms']:.1f}",
                f"{r['direct_ttfb_p99_ms']:.1f}",
                f"{r['peak_rss_mib']:.0f}",
            )
            for r in rows
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10)
    args = parser.parse_args()
    rows = run(args.seconds)
    save("load", rows)
    print_table(rows)


if __name__ == "__main__":
    main()

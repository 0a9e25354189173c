"""Proxy overhead, side by side with direct, in one run.

Three processes on loopback: a fake llama-server with zero service time (enough slots that
nothing queues), the proxy (``python -m proxy serve``, INFO access log to /dev/null), and this
load generator. For each concurrency, closed-loop workers send small requests straight to the
fake and then through the proxy; the table shows latency percentiles of both and the
difference (the proxy's added latency), time to first byte for streams, and requests/s.
``--store redis`` runs the proxy on a fresh redis-server (shared state, as replicas do);
``--store memory redis`` measures both proxies in the same run. ``--store forwarded`` runs two
proxy replicas on one redis-server and sends the load to the one that is not the backend's home,
so every request takes the forwarded hop (``proxy.http.forwarding``): its row minus the ``redis``
row is what that hop adds.

    python -m bench.overhead [--requests 3000] [--concurrency 1 16 64] \
        [--store memory redis forwarded]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import aiohttp

from bench.results_io import print_markdown
from testbed.probes import metric, until_listed
from testbed.stack import REPLICA_SECRET, RedisServer, fake_command, free_port, wait_http

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@contextmanager
def _process(
    args: list[str], ready_url: str, source: str | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """The process of ``args`` while it runs, once ``ready_url`` answers; ``source``: a
    checkout whose proxy it runs (its directory first on the path)."""
    env = {**os.environ, **REPLICA_SECRET}  # replicas on one Redis forward to each other
    if source is not None:
        env["PYTHONPATH"] = source
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=source
    )
    try:
        wait_http(ready_url, 30, proc)
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


async def _worker(
    session: aiohttp.ClientSession, url: str, count: int, stream: bool, out: list[float]
) -> None:
    body = {**BODY, "stream": stream}
    for _ in range(count):
        started = time.perf_counter()
        async with session.post(url, json=body) as resp:
            if stream:
                await resp.content.readany()  # first byte
                out.append(time.perf_counter() - started)
                await resp.read()
            else:
                await resp.read()
                out.append(time.perf_counter() - started)
            assert resp.status == 200, resp.status


async def _load(url: str, concurrency: int, total: int, stream: bool) -> tuple[list[float], float]:
    samples: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await _worker(session, url, 20, stream, [])  # warm-up
        per = max(1, total // concurrency)
        started = time.perf_counter()
        await asyncio.gather(
            *(_worker(session, url, per, stream, samples) for _ in range(concurrency))
        )
        elapsed = time.perf_counter() - started
    return samples, len(samples) / elapsed


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def run(requests: int, concurrencies: list[int], stores: list[str]) -> list[dict[str, object]]:
    fake_port = free_port()
    fake = f"http://127.0.0.1:{fake_port}"
    slots = max(concurrencies)
    rows: list[dict[str, object]] = []
    fake_args = fake_command(fake_port, slots)
    redis = RedisServer().start() if {"redis", "forwarded"} & set(stores) else None
    try:
        with _process(fake_args, fake + "/health"):
            for store in stores:
                with ExitStack() as stack:
                    replicas = 2 if store == "forwarded" else 1
                    urls = [
                        _proxy(stack, fake, redis.url if redis and store != "memory" else None)
                        for _ in range(replicas)
                    ]
                    proxy = _forwarder(urls) if replicas > 1 else urls[0]
                    rows += _measure(fake, proxy, store, requests, concurrencies)
    finally:
        if redis is not None:
            redis.stop()
    return rows


def _proxy(stack: ExitStack, fake: str, redis_url: str | None) -> str:
    """A proxy process in front of ``fake`` (on ``redis_url``, if any); returns its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        *(sys.executable, "-m", "proxy", "serve", "--backend", fake),
        *("--listen", f"127.0.0.1:{port}"),
        *(("--redis-url", redis_url) if redis_url else ()),
    ]
    stack.enter_context(_process(args, url + "/readyz"))
    return url


def _forwarder(urls: list[str]) -> str:
    """Of two replicas, the one that forwards the backend's requests to the other."""

    async def sent(url: str) -> float:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/chat/completions", json=BODY) as resp:
                await resp.read()
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
        return metric(text, "llama_cache_proxy_forwarded_requests_total", outcome="sent")

    asyncio.run(until_listed(urls))
    chosen = [url for url in urls if asyncio.run(sent(url)) > 0]
    if len(chosen) != 1:
        raise SystemExit(f"expected one forwarding replica, found {len(chosen)}")
    return chosen[0]


def _measure(
    fake: str, proxy: str, store: str, requests: int, concurrencies: list[int]
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for stream in (False, True):
        for concurrency in concurrencies:
            d, d_rps = asyncio.run(
                _load(fake + "/v1/chat/completions", concurrency, requests, stream)
            )
            p, p_rps = asyncio.run(
                _load(proxy + "/v1/chat/completions", concurrency, requests, stream)
            )
            rows.append(
                {
                    "mode": "stream TTFB" if stream else "request",
                    "store": store,
                    "conc": concurrency,
                    "direct_p50": _pct(d, 0.5),
                    "proxy_p50": _pct(p, 0.5),
                    "direct_p99": _pct(d, 0.99),
                    "proxy_p99": _pct(p, 0.99),
                    "direct_rps": d_rps,
                    "proxy_rps": p_rps,
                }
            )
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; fake backend with zero service time"
    )
    header = (
        "mode",
        "store",
        "conc",
        "direct p50 ms",
        "proxy p50 ms",
        "added p50 ms",
        "direct p99 ms",
        "proxy p99 ms",
        "added p99 ms",
        "direct req/s",
        "proxy req/s",
    )
    cells = []
    for r in rows:
        dp50, pp50 = float(r["direct_p50"]), float(r["proxy_p50"])  # type: ignore[arg-type]
        dp99, pp99 = float(r["direct_p99"]), float(r["proxy_p99"])  # type: ignore[arg-type]
        direct_rps, proxy_rps = float(r["direct_rps"]), float(r["proxy_rps"])  # type: ignore[arg-type]
        cells.append(
            (
                r["mode"],
                r.get("store", "memory"),
                r["conc"],
                f"{dp50:.2f}",
                f"{pp50:.2f}",
                f"{pp50 - dp50:.2f}",
                f"{dp99:.2f}",
                f"{pp99:.2f}",
                f"{pp99 - dp99:.2f}",
                f"{direct_rps:.0f}",
                f"{proxy_rps:.0f}",
            )
        )
    print_markdown(header, cells)
    added = statistics.median(
        float(str(r["proxy_p50"])) - float(str(r["direct_p50"])) for r in rows
    )
    print(f"median of added p50 across rows: {added:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--store",
        nargs="+",
        choices=["memory", "redis", "forwarded"],
        default=["memory"],
        help="proxy state (forwarded: two replicas, every request forwarded once)",
    )
    args = parser.parse_args()
    print_table(run(args.requests, args.concurrency, args.store))


if __name__ == "__main__":
    main()

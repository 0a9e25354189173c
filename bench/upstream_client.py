"""The request path's HTTP client alone: ``proxy.upstream_http`` against aiohttp's client.

One fake llama-server (64 slots, zero service time) as its own process; in this process, on
uvloop as the proxy runs, one request at a time posts a tiny chat body and reads the whole
answer, through ``upstream_http.Pool`` and through an ``aiohttp.ClientSession`` set up as
the proxy had it (no connection limit, no cookie jar, the same timeouts), in alternating
rounds. The table gives each client's median over rounds of the CPU this process used per
request (``time.process_time``) and of the wall time per request.

    python -m bench upstream_client [--rounds 5] [--requests 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from bench.overhead import _process
from bench.peer_overhead import body
from bench.results_io import machine_line, print_markdown, save
from proxy.cli import event_loop
from proxy.upstream_http import Pool
from testbed.stack import fake_command, free_port

PATH = "/v1/chat/completions"
HEADERS = [("Content-Type", "application/json")]
Send = Callable[[bytes], Awaitable[bytes]]


async def _measure(send: Send, payload: bytes, count: int) -> tuple[float, float]:
    """CPU and wall microseconds per request of ``count`` requests, one at a time."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(count):
        await send(payload)
    return (
        (time.process_time() - cpu) / count * 1e6,
        (time.perf_counter() - wall) / count * 1e6,
    )


async def run(url: str, rounds: int, requests: int) -> dict[str, dict[str, list[float]]]:
    payload = json.dumps(body("tiny", 0)).encode()
    pool = Pool(5.0, 600.0)
    timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=600.0)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())

    async def lean(data: bytes) -> bytes:
        response = await pool.request(url, PATH, "POST", data, HEADERS)
        answer = await response.read()
        response.release()
        return answer

    async def general(data: bytes) -> bytes:
        async with session.post(url + PATH, data=data, headers=HEADERS, timeout=timeout) as r:
            return await r.read()

    clients: dict[str, Send] = {"upstream_http": lean, "aiohttp": general}
    out: dict[str, dict[str, list[float]]] = {n: {"cpu_us": [], "wall_us": []} for n in clients}
    try:
        for send in clients.values():  # warm-up: connections open, code paths hot
            await _measure(send, payload, requests // 10)
        for _ in range(rounds):
            for name, send in clients.items():
                cpu, wall = await _measure(send, payload, requests)
                out[name]["cpu_us"].append(cpu)
                out[name]["wall_us"].append(wall)
    finally:
        pool.close()
        await session.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _process(fake_command(port, 64), url + "/health"):
        loop = event_loop()
        try:
            result = loop.run_until_complete(run(url, args.rounds, args.requests))
        finally:
            loop.close()
    shape = f"one request at a time, {args.requests} per round, {args.rounds} rounds"
    print(f"{machine_line()}; {shape}")
    rows: list[dict[str, Any]] = []
    for name, values in result.items():
        rows.append(
            {
                "client": name,
                "cpu_us": values["cpu_us"],
                "wall_us": values["wall_us"],
                "median_cpu_us": statistics.median(values["cpu_us"]),
                "median_wall_us": statistics.median(values["wall_us"]),
            }
        )
    print_markdown(
        ["client", "CPU per request (µs)", "wall per request (µs)", "CPU per round (µs)"],
        [
            [
                r["client"],
                f"{r['median_cpu_us']:.0f}",
                f"{r['median_wall_us']:.0f}",
                " / ".join(f"{v:.0f}" for v in r["cpu_us"]),
            ]
            for r in rows
        ],
    )
    save("upstream_client", rows)


if __name__ == "__main__":
    main()

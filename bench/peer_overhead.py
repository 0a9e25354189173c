"""The proxy's overhead under concurrency, side by side with a peer router, in one run.

Processes on loopback: one fake llama-server with zero service time and 64 slots, the proxy
(``python -m proxy serve``, defaults, in-memory state), each installed peer router named
with ``--peers`` (its cache-aware policy: ``python -m bench.peers install`` first), and this
load generator. Per prompt size and concurrency, closed-loop workers send the same number of
requests straight to the fake, through the proxy and through each peer; the table gives
requests/s and the latency each adds over direct at p50, and the proxy's throughput as a
ratio of each peer's.

Prompts: ``tiny`` is a one-word chat message; ``4k`` gives each worker its own
4,000-word user message, repeated on every request of that worker (an agent resending its
context), so the router fingerprints 4,000 tokens per request.

    python -m bench.peer_overhead [--requests 2000] [--concurrency 1 16 64] \
        [--prompts tiny 4k] [--peers sglang-router] [--floor]

``--floor`` adds ``bench.bare_relay``, an aiohttp relay with no routing at all (column
``bare``): what any Python relay adds on the machine, the floor under the proxy's figure.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import aiohttp

from bench.overhead import _pct, _process
from bench.peers import available_peers
from bench.results_io import machine_line, print_markdown, save
from testbed.stack import fake_command, free_port

SLOTS = 64
PROMPT_WORDS = {"tiny": 1, "4k": 4000}


def body(prompt: str, worker: int) -> dict[str, Any]:
    words = PROMPT_WORDS[prompt]
    text = "hi" if words == 1 else " ".join(f"w{worker}x{i % 997}" for i in range(words))
    return {"model": "fake-model", "messages": [{"role": "user", "content": text}], "max_tokens": 1}


async def _worker(
    session: aiohttp.ClientSession, url: str, request: dict[str, Any], count: int, out: list[float]
) -> None:
    for _ in range(count):
        started = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", json=request) as resp:
            await resp.read()
            if resp.status != 200:
                raise SystemExit(f"{url}: status {resp.status}")
        out.append(time.perf_counter() - started)


async def load(url: str, prompt: str, concurrency: int, total: int) -> dict[str, float]:
    """Closed-loop ``concurrency`` workers, ``total`` requests: p50 in ms and requests/s."""
    samples: list[float] = []
    per = max(1, total // concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await _worker(session, url, body(prompt, 0), 10, [])  # warm-up
        started = time.perf_counter()
        await asyncio.gather(
            *(_worker(session, url, body(prompt, w), per, samples) for w in range(concurrency))
        )
        elapsed = time.perf_counter() - started
    return {"p50": _pct(samples, 0.5), "rps": len(samples) / elapsed}


@asynccontextmanager
async def _bare(fake: str) -> AsyncIterator[str]:
    """``bench.bare_relay``: the floor of an aiohttp relay on this machine."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _process([sys.executable, "-m", "bench.bare_relay", fake, str(port)], url + "/readyz"):
        yield url


@asynccontextmanager
async def _proxy(fake: str) -> AsyncIterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "proxy", "serve", "--backend", fake]
    with _process([*args, "--listen", f"127.0.0.1:{port}"], url + "/readyz"):
        yield url


async def run(
    requests: int,
    concurrencies: list[int],
    prompts: list[str],
    peers: list[str],
    floor: bool = False,
) -> list[dict[str, Any]]:
    started = available_peers()
    missing = [p for p in peers if p not in started]
    if missing:
        raise SystemExit(f"not installed: {missing} (python -m bench.peers install)")
    routers: dict[str, Callable[[list[str]], AbstractAsyncContextManager[str]]] = {
        "proxy": lambda urls: _proxy(urls[0]),
        **{p: started[p] for p in peers},
    }
    if floor:
        routers["bare"] = lambda urls: _bare(urls[0])
    port = free_port()
    fake = f"http://127.0.0.1:{port}"
    args = fake_command(port, SLOTS)
    rows: list[dict[str, Any]] = []
    with _process(args, fake + "/health"):
        for prompt in prompts:
            for concurrency in concurrencies:
                row: dict[str, Any] = {"prompt": prompt, "conc": concurrency}
                row["direct"] = await load(fake, prompt, concurrency, requests)
                for name, start in routers.items():
                    async with start([fake]) as url:
                        row[name] = await load(url, prompt, concurrency, requests)
                rows.append(row)
                print(row, flush=True)
    return rows


def print_table(rows: list[dict[str, Any]], peers: list[str]) -> None:
    header = ["prompt", "conc", "direct req/s", "proxy req/s", "proxy added p50 ms"]
    if rows and "bare" in rows[0]:
        peers = ["bare", *peers]
    for peer in peers:
        header += [f"{peer} req/s", f"{peer} added p50 ms", f"proxy / {peer}"]
    cells = []
    for r in rows:
        d, p = r["direct"], r["proxy"]
        cell = [r["prompt"], r["conc"], f"{d['rps']:.0f}", f"{p['rps']:.0f}"]
        cell.append(f"{p['p50'] - d['p50']:.2f}")
        for peer in peers:
            q = r[peer]
            cell += [f"{q['rps']:.0f}", f"{q['p50'] - d['p50']:.2f}", f"{p['rps'] / q['rps']:.2f}"]
        cells.append(tuple(cell))
    print_markdown(tuple(header), cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompts", nargs="+", choices=sorted(PROMPT_WORDS), default=["tiny"])
    parser.add_argument("--peers", nargs="*", default=["sglang-router"])
    parser.add_argument("--out", default="peer_overhead")
    parser.add_argument(
        "--floor", action="store_true", help="also run bench.bare_relay (column 'bare')"
    )
    args = parser.parse_args()
    rows = asyncio.run(
        run(args.requests, args.concurrency, args.prompts, args.peers, floor=args.floor)
    )
    print(
        f"{machine_line()}; {args.requests} requests per cell; fake backend with {SLOTS} slots "
        "and zero service time"
    )
    print_table(rows, args.peers)
    save(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

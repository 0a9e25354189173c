"""One client's added latency of this checkout's proxy and of other checkouts', paired.

A change of a few tens of microseconds per request is within the spread of
``bench.peer_overhead``, which starts a proxy per cell: runs minutes apart see different
machine states. Here one fake llama-server (64 slots, zero service time) and every proxy
(``python -m proxy serve``, defaults: the access log at INFO, to /dev/null) run at once,
and a closed-loop client (``--concurrency`` requests in flight, 1 by default) sends
``--requests`` tiny chat requests per round to the fake directly and to each proxy in turn,
``--rounds`` times. The table gives each one's p50 per round, the median over rounds, what
that adds over direct, the median throughput, and the CPU each proxy process used per
request (Linux: ``/proc``).

    python -m bench paired_overhead --checkout base=DIR [--checkout NAME=DIR ...] \
        [--rounds 4] [--requests 2000] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp

from bench.overhead import _process
from bench.peer_overhead import _worker, body
from bench.results_io import machine_line, print_markdown, save
from testbed.stack import fake_command, free_port


def _cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds of process ``pid`` so far (None off Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _round(
    session: aiohttp.ClientSession, url: str, count: int, concurrency: int
) -> tuple[float, float]:
    """p50 seconds and requests/s of ``count`` tiny chat requests, ``concurrency`` at a time."""
    out: list[float] = []
    per = max(1, count // concurrency)
    started = time.perf_counter()
    await asyncio.gather(
        *(_worker(session, url, body("tiny", w), per, out) for w in range(concurrency))
    )
    return statistics.median(out), len(out) / (time.perf_counter() - started)


async def run(
    checkouts: dict[str, str | None], rounds: int, requests: int, concurrency: int = 1
) -> list[dict[str, Any]]:
    fake_port = free_port()
    fake = f"http://127.0.0.1:{fake_port}"
    with ExitStack() as stack:
        stack.enter_context(_process(fake_command(fake_port, 64), fake + "/health"))
        urls, pids = {"direct": fake}, {}
        for name, source in checkouts.items():
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            args = [sys.executable, "-m", "proxy", "serve", "--backend", fake]
            proc = stack.enter_context(
                _process([*args, "--listen", f"127.0.0.1:{port}"], url + "/readyz", source)
            )
            urls[name], pids[name] = url, proc.pid
        p50s: dict[str, list[float]] = {name: [] for name in urls}
        rates: dict[str, list[float]] = {name: [] for name in urls}
        cpu: dict[str, float] = {name: 0.0 for name in pids}
        done = max(1, requests // concurrency) * concurrency  # requests per round
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            for url in urls.values():  # a warm-up round each
                await _round(session, url, requests // 10, concurrency)
            for _ in range(rounds):
                for name, url in urls.items():
                    before = _cpu_seconds(pids[name]) if name in pids else None
                    p50, rate = await _round(session, url, requests, concurrency)
                    p50s[name].append(p50)
                    rates[name].append(rate)
                    after = _cpu_seconds(pids[name]) if name in pids else None
                    if before is not None and after is not None:
                        cpu[name] += after - before
    direct = statistics.median(p50s["direct"])
    rows = []
    for name, values in p50s.items():
        median = statistics.median(values)
        rows.append(
            {
                "name": name,
                "p50_ms": [v * 1000 for v in values],
                "median_p50_ms": median * 1000,
                "added_ms": (median - direct) * 1000,
                "median_rps": statistics.median(rates[name]),
                "cpu_ms_per_request": cpu[name] * 1000 / (rounds * done) if name in cpu else None,
            }
        )
    return rows


def checkouts(items: list[str]) -> dict[str, str | None]:
    """``--checkout NAME=DIR`` items as names to checkout directories, after ``this``
    (None: the checkout running the benchmark)."""
    found: dict[str, str | None] = {"this": None}
    for item in items:
        name, _, source = item.partition("=")
        if not name or not source or not Path(source, "proxy").is_dir():
            raise SystemExit(f"--checkout {item!r}: NAME=DIR, DIR a checkout of the proxy")
        found[name] = str(Path(source).resolve())
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkout", action="append", default=[], metavar="NAME=DIR", help="another proxy"
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    args = parser.parse_args()
    rows = asyncio.run(run(checkouts(args.checkout), args.rounds, args.requests, args.concurrency))
    clients = "one client" if args.concurrency == 1 else f"{args.concurrency} clients"
    print(f"{machine_line()}; {clients}, {args.requests} requests per round, {args.rounds} rounds")
    print_markdown(
        ["", "p50 per round (ms)", "median (ms)", "added (ms)", "req/s", "CPU per request (ms)"],
        [
            [
                r["name"],
                " / ".join(f"{v:.3f}" for v in r["p50_ms"]),
                f"{r['median_p50_ms']:.3f}",
                "" if r["name"] == "direct" else f"{r['added_ms']:.3f}",
                f"{r['median_rps']:.0f}",
                "" if r["cpu_ms_per_request"] is None else f"{r['cpu_ms_per_request']:.3f}",
            ]
            for r in rows
        ],
    )
    save("paired_overhead", {"concurrency": args.concurrency, "rows": rows})


if __name__ == "__main__":
    main()

"""What a Redis outage costs the clients of two proxy replicas, on a real llama-server.

One llama-server (``testbed/stack.py``: SmolLM2-135M, 2 slots), one redis-server and two
proxy processes sharing it; four clients each send short chats (4 tokens) in a loop, turn
by turn to the two replicas. After ``--before`` seconds Redis stops, ``--outage`` seconds
later it starts again, and the traffic runs ``--after`` seconds more. Per run: the requests
served, how many failed (none should), and the slowest request — the stall while replicas
go over to local state (and drain, and wait until their peers must have fenced their part)
and back.

    python -m bench.outage [--runs 6] [--outage 2.0]
"""

from __future__ import annotations

import argparse
import asyncio
import platform

import aiohttp

from bench.results_io import print_markdown
from testbed.stack import (
    LlamaServer,
    ProxyProcess,
    RedisServer,
    Served,
    looping_client,
    require_real_stack,
)


async def one_run(before: float, outage: float, after: float) -> dict[str, float]:
    binary, model = require_real_stack()
    server = LlamaServer(binary, model, slots=2).start()
    redis = RedisServer().start()
    pair = [ProxyProcess([server.url], redis_url=redis.url).start() for _ in range(2)]
    served: list[Served] = []
    stop = asyncio.Event()
    try:
        async with aiohttp.ClientSession() as session:
            urls = [proxy.url for proxy in pair]
            clients = [
                asyncio.create_task(looping_client(session, urls, w, stop, served))
                for w in range(4)
            ]
            await asyncio.sleep(before)
            redis.stop()
            await asyncio.sleep(outage)
            redis.start()
            await asyncio.sleep(after)
            stop.set()
            await asyncio.gather(*clients)
    finally:
        for proxy in pair:
            proxy.stop()
        redis.stop()
        server.cleanup()
    return {
        "requests": len(served),
        "failed": sum(s.status != 200 for s in served),
        "worst_s": max(s.answered - s.sent for s in served),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--before", type=float, default=1.0)
    parser.add_argument("--outage", type=float, default=2.0)
    parser.add_argument("--after", type=float, default=2.0)
    args = parser.parse_args()
    rows: list[dict[str, float]] = []
    for run in range(args.runs):
        result = asyncio.run(one_run(args.before, args.outage, args.after))
        rows.append({"run": run, **result})
        print(rows[-1], flush=True)
    print(f"\n{platform.machine()}, Redis down {args.outage} s under 4 looping clients")
    cells = [[r["run"], r["requests"], r["failed"], f"{r['worst_s']:.2f}"] for r in rows]
    print_markdown(["run", "requests", "failed", "slowest request (s)"], cells)


if __name__ == "__main__":
    main()

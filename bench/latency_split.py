"""Where a replayed request's time goes, per policy: the backend, the proxy's queue, the rest.

    python -m bench.latency_split [--only mooncake/conversation_trace] \\
        [--policies ours sglang-router] [--repeat 2]

Replays one workload as ``bench.replay --process`` does (ours as its own process, as the
peer routers run) and splits each request's latency, as the client saw it, into:

- *backend*: from the fake llama-server receiving the request to its handler returning the
  reply (a request a peer router forwards at once waits in the server's own queue, so this
  includes it);
- *queue* and *route* (ours only, from its ``Server-Timing`` header): waiting in the proxy for
  a slot, and reading, fingerprinting and planning before asking for one;
- *hops*: the rest, the router's processing and the two HTTP hops through it, both ways.

Figures: docs/benchmarks.md (trace replay, latency against sglang-router).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import time
from collections.abc import Mapping
from typing import Any

from bench import replay
from bench.results_io import print_markdown
from testbed.fake_llama import FakeLlamaServer
from testbed.probes import server_timing

SEGMENTS = ("latency", "backend", "queue", "route", "hops")


class _Timeline:
    """Per prompt text, the (arrival, departure) of each request the fakes served, in order."""

    def __init__(self) -> None:
        self.served: dict[str, collections.deque[tuple[float, float]]] = collections.defaultdict(
            collections.deque
        )
        self._complete = FakeLlamaServer.complete

    def __enter__(self) -> _Timeline:
        complete, served = self._complete, self.served

        async def timed(fake: FakeLlamaServer, request: Any) -> Any:
            arrived = time.perf_counter()
            prompt = str((await request.json()).get("prompt"))
            try:
                return await complete(fake, request)
            finally:
                served[prompt].append((arrived, time.perf_counter()))

        FakeLlamaServer.complete = timed  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        FakeLlamaServer.complete = self._complete  # type: ignore[method-assign]


async def split(policy: str, row: str, peers: dict[str, Any]) -> dict[str, float]:
    """Mean milliseconds per segment over one run of ``policy`` on workload ``row``."""
    ((workload, shape),) = replay.scenarios(True, [row])
    backends, slots = shape or (4, 4)
    seen: list[tuple[str, float, Mapping[str, str]]] = []

    def observe(where: tuple[int, int], body: dict[str, Any], headers: Mapping[str, str]) -> None:
        prompt = workload.sessions[where[0]][where[1]][0]
        seen.append((prompt, replay.LATENCIES[-1], headers))

    replay.OBSERVE, replay.PROCESS = observe, True
    with _Timeline() as timeline:
        await replay.run_policy(policy, workload, backends, slots, peers)
    parts: dict[str, list[float]] = collections.defaultdict(list)
    for prompt, latency, headers in seen:  # a prompt sent again: its requests in order
        arrived, left = timeline.served[prompt].popleft()
        timing = server_timing(headers.get("Server-Timing", "queue;dur=0, route;dur=0"))
        backend = left - arrived
        parts["latency"].append(latency * 1000)
        parts["backend"].append(backend * 1000)
        parts["queue"].append(timing.get("queue", 0.0))
        parts["route"].append(timing.get("route", 0.0))
        proxy = (timing.get("queue", 0.0) + timing.get("route", 0.0)) / 1000
        parts["hops"].append((latency - backend - proxy) * 1000)
    return {name: statistics.fmean(values) for name, values in parts.items()}


async def main_async(args: argparse.Namespace) -> None:
    from bench.peers import available_peers

    peers = available_peers()
    rows: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    for _ in range(args.repeat):  # rounds, as bench.replay does, so drift is shared
        for policy in args.policies:
            rows[policy].append(await split(policy, args.only, peers))
    print(f"\n{args.only}, mean ms per request over {args.repeat} run(s) of each policy")
    print_markdown(
        ("policy", *SEGMENTS),
        (
            (p, *(f"{statistics.fmean(r[s] for r in runs):.1f}" for s in SEGMENTS))
            for p, runs in rows.items()
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="mooncake/conversation_trace")
    parser.add_argument("--policies", nargs="+", default=["ours", "sglang-router"])
    parser.add_argument("--repeat", type=int, default=1)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()

"""Per-request replay: what each request of one workload got, run after run, to find where
one policy (or one version of the proxy) loses tokens to another.

    python -m bench.per_request run --policies ours sglang-router --runs 10 \\
        --only lmcache/taubench --out /tmp/a.json
    python -m bench.per_request diff /tmp/a.json:ours /tmp/a.json:sglang-router

``run`` replays the workload as ``bench.replay`` does (same fakes, fleet and policies;
peers when installed; ``--chat``, ``--no-ram-cache``, ``--ram-tokens``,
``--no-cache-idle-slots``, ``--replicas``, ``--shard`` and ``--routing`` as there) and
keeps, per run and request, (session, position, prompt tokens, cached tokens,
X-Cache-Route, X-Cache-Backend, X-Cache-Slot, X-Cache-Predicted-Tokens).
``diff A B`` averages each request's cached tokens over the runs of each side and prints
B - A in total, by prompt size, by A's route, and the requests where B gains most.

A hit-rate difference of 0.001 on taubench is ~56 tokens, below one run's spread (about
0.002), so compare versions with many runs each, alternating them (two worktrees), rather
than one batch after the other: once two 10-run batches of the same code gave
0.8727 and 0.8739.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench import replay
from bench.results_io import save

Row = list[Any]  # [[session, position], prompt, cached, route, backend, slot, predicted]


async def run(policies: list[str], runs: int, only: str, backends: int, slots: int) -> Any:
    from bench.peers import available_peers

    peers = available_peers()
    ((workload, shape),) = replay.scenarios(True, [only])
    backends, slots = shape or (backends, slots)
    log: list[Row] = []

    def observe(where: tuple[int, int], body: dict[str, Any], headers: Mapping[str, str]) -> None:
        usage = body.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        row = [list(where), usage.get("prompt_tokens", 0), cached]
        names = ("Route", "Backend", "Slot", "Predicted-Tokens")
        log.append(row + [headers.get(f"X-Cache-{name}") for name in names])

    replay.OBSERVE = observe
    out: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for i in range(runs):  # rounds, as bench.replay does, so drift is shared
        for policy in policies:
            log.clear()
            run = await replay.run_policy(policy, workload, backends, slots, peers)
            out[policy].append({"hit": run.hit, "seconds": run.seconds, "log": list(log)})
            print(f"{policy} run {i}: hit {run.hit:.4f} in {run.seconds:.1f} s", flush=True)
    return out


def _load(spec: str) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], int], Any]:
    path, _, policy = spec.partition(".json:")  # policies may hold ':' (sglang-router:manual)
    path += ".json"
    with open(path) as f:
        runs = json.load(f)[policy]
    cached: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    size: dict[tuple[int, int], int] = {}
    routes: dict[tuple[int, int], list[str]] = collections.defaultdict(list)
    for r in runs:
        for where, prompt, got, route, *_ in r["log"]:
            key = (where[0], where[1])
            cached[key].append(got)
            size[key] = prompt
            routes[key].append(route or "-")
    mean = {k: statistics.fmean(v) for k, v in cached.items()}
    print(f"{spec}: {len(runs)} runs, hit {statistics.fmean(r['hit'] for r in runs):.4f}")
    return mean, size, routes


def diff(a: str, b: str, top: int) -> None:
    mean_a, size, routes = _load(a)
    mean_b, _, _ = _load(b)
    gain = {k: mean_b.get(k, 0.0) - v for k, v in mean_a.items()}
    print(f"prompt tokens {sum(size.values())}; B - A cached: {sum(gain.values()):+.1f}")
    by_size: dict[str, float] = collections.defaultdict(float)
    by_route: dict[str, float] = collections.defaultdict(float)
    for k, g in gain.items():
        n = size[k]
        by_size["<16" if n < 16 else "<128" if n < 128 else ">=128"] += g
        by_route[collections.Counter(routes[k]).most_common(1)[0][0]] += g
    print("by prompt size:", {k: round(v, 1) for k, v in by_size.items()})
    print("by A's usual route:", {k: round(v, 1) for k, v in by_route.items()})
    for k, _ in sorted(gain.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {k} {size[k]} tokens: A {mean_a[k]:.1f} B {mean_b.get(k, 0):.1f} {routes[k]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--policies", nargs="+", default=["ours"])
    r.add_argument("--runs", type=int, default=10)
    r.add_argument("--only", default="lmcache/taubench")
    r.add_argument("--backends", type=int, default=4)
    r.add_argument("--slots", type=int, default=4)
    r.add_argument("--out", required=True)
    r.add_argument("--chat", action="store_true", help="as bench.replay --chat")
    r.add_argument("--no-ram-cache", action="store_true", help="as bench.replay")
    r.add_argument("--ram-tokens", type=int, help="as bench.replay")
    r.add_argument("--no-cache-idle-slots", action="store_true", help="as bench.replay")
    r.add_argument("--replicas", type=int, default=1, help="as bench.replay")
    r.add_argument("--shard", action="store_true", help="as bench.replay")
    r.add_argument("--routing", type=json.loads, default={}, help="as bench.replay")
    d = sub.add_parser("diff")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if args.command == "run":
        replay.CHAT, replay.RAM_CACHE = args.chat, not args.no_ram_cache
        replay.RAM_TOKENS, replay.REPLICAS = args.ram_tokens, args.replicas
        replay.IDLE_SAVES = not args.no_cache_idle_slots
        replay.SHARD = args.shard
        replay.ROUTING.update(args.routing)
        found = asyncio.run(run(args.policies, args.runs, args.only, args.backends, args.slots))
        save(str(Path(args.out).resolve()), found)  # a file path, with the run's provenance
    else:
        diff(args.a, args.b, args.top)


if __name__ == "__main__":
    main()

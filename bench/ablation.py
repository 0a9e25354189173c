"""Ablation of the routing rules: which of them move the hit rate or the latency in the replay.

Each ablation takes one rule of ``proxy.core.routing.decision`` / ``core.routing.waiting`` /
``core.routing.scoring`` away, either through a routing setting or by patching, in-process, the name
where the router uses it (``routing.spare_parked``, not ``waiting.spare_parked``: routing imports it
by name), and runs policy ``ours`` of ``bench.replay`` (same fakes, same default timing, the hit
rate read from the fakes' counters) on a few trace rows; ``baseline`` runs unpatched. Runs go in
rounds, every variant once per round (as ``bench.replay``), so drift is shared; the baseline
runs at least twice so that its run-to-run spread is visible. A patched rule counts the calls
whose value it changed (it differs from the unpatched function's on the same inputs): one
that changed none decides as the baseline, and its runs show the spread too. (A patched
predicate inside ``worth_waiting`` counts the calls where it would have held, not whether
the decision changed.)

    python -m bench.ablation [--repeat N] [--baseline N] [--only WORKLOAD ...] \
        [--ablations ID ...] [--backends 4] [--slots 4] [--chat] [--no-ram-cache | --ram-tokens N]

Prints a Markdown table (hit rate, its delta against the baseline mean, mean request latency)
and saves every run under ``bench/results/ablation/`` (with the commit and the command line,
as every result: ``bench.results_io``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from bench import replay
from bench.results_io import load, print_markdown, save
from proxy.config import sections as config_sections
from proxy.core.routing import decision as routing
from proxy.core.routing import waiting
from proxy.core.routing.index import BackendIndex
from proxy.core.server.fleet import BackendState, SlotState

WORKLOADS = ["lmcache/taubench", "lmcache/taubench (6 sessions, 2x3)", "lmcache/magagent"]
WORKLOADS += ["mooncake/conversation_trace"]
Fired = list[int]  # one counter: calls whose value a patched rule changed in this run
Patch = Callable[[Fired], AbstractContextManager[Any]]


def _swap(
    target: object, name: str, ablated: Callable[..., Any], key: Callable[[Any], Any] | None = None
) -> Patch:
    """Patch ``target.name`` with ``ablated``, counting calls whose result (by ``key``, or
    the value itself) differs from the original's on the same arguments."""
    original = getattr(target, name)
    seen = key or (lambda value: value)

    def patcher(fired: Fired) -> AbstractContextManager[Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            new = ablated(*args, **kwargs)
            if seen(new) != seen(original(*args, **kwargs)):
                fired[0] += 1
            return new

        return mock.patch.object(target, name, wrapper)

    return patcher


def _const(value: Any) -> Callable[..., Any]:
    return lambda *args, **kwargs: value


def _unpressed(
    backends: Sequence[BackendState],
    free: Mapping[int, Sequence[SlotState]],
    sat: bool,
    _: bool,
    index: Mapping[int, BackendIndex],
) -> waiting.Fleetview:
    return waiting.Fleetview(backends, free, sat, False, index)


_UNPRESSED = (_unpressed, lambda view: view.pressed)  # counted: decisions that were pressed


@dataclass(frozen=True)
class Ablation:
    id: str
    what: str  # the rule taken away
    patches: Sequence[Patch] = ()  # each counts the calls whose value it changed
    routing: dict[str, Any] = field(default_factory=dict)  # routing settings over the defaults
    params: dict[str, Any] = field(default_factory=dict)  # RoutingParams fields no setting has

    @contextmanager
    def applied(self, fired: Fired) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(mock.patch.dict(replay.ROUTING, self.routing))
            for patch in self.patches:
                stack.enter_context(patch(fired))
            if self.params:
                settings = config_sections.RoutingSettings
                made = settings.params  # the original: this ablation patches it alone
                over = lambda s: dataclasses.replace(made(s), **self.params)  # noqa: E731
                stack.enter_context(mock.patch.object(settings, "params", over))
            yield


R, W, A, NO, WW = routing, waiting, Ablation, _const(False), "worth_waiting"
ABLATIONS = [
    A("baseline", "nothing: the rules as they are"),
    A("holds", "holds off (returns.held: never)", [_swap(R, "held", NO)]),
    A("wait", "no wait (worth_waiting: None)", [_swap(R, WW, _const(None))]),
    A("saturation", "saturation off (crowded: never)", [_swap(R, "crowded", NO)]),
    A("pressure", "queue pressure off (pressed: never)", [_swap(R, "Fleetview", *_UNPRESSED)]),
    A("spare-parked", "spare_parked off", [_swap(R, "spare_parked", _const(None))]),
    A("ram-wait", "full-backend RAM wait off", [_swap(W, "_ram_wait", NO)]),
    A("empty-rule", "'only a slot it would take' off", [_swap(W, "_only_taken", NO)]),
    A("eviction", "eviction damage off (eviction_weight 0)", params={"eviction_weight": 0.0}),
    A("ram-discount", "RAM-parked loss in full (ram_discount 1.0)", params={"ram_discount": 1.0}),
    A("min-prefix", "no hit floor (min_prefix_tokens 0)", routing={"min_prefix_tokens": 0}),
    A("recency", "recency off (half life 1e9 s)", routing={"value_half_life_seconds": 1e9}),
    A("wait-128", "wait bar lowered (wait_min_tokens 128)", routing={"wait_min_tokens": 128}),
    A("wait-4096", "wait bar raised (wait_min_tokens 4096)", routing={"wait_min_tokens": 4096}),
    A(
        "wait-share",
        "wait bar a share alone (wait_min_tokens 1e9)",
        routing={"wait_min_tokens": 10**9},
    ),
    A(
        "wait-tokens",
        "wait bar in tokens alone (wait_min_fraction 1)",
        routing={"wait_min_fraction": 1.0},
    ),
]


async def run_rows(args: argparse.Namespace, chosen: list[Ablation]) -> list[dict[str, Any]]:
    rows, started = [], time.perf_counter()
    for workload, shape in replay.scenarios(True, only=args.only):
        backends, slots = shape or (args.backends, args.slots)
        runs: dict[str, list[dict[str, Any]]] = {a.id: [] for a in chosen}
        for round_ in range(max(args.repeat, args.baseline)):  # every variant once per round
            for a in chosen:
                if round_ >= (args.baseline if a.id == "baseline" else args.repeat):
                    continue
                fired = [0]
                with a.applied(fired):
                    run = await replay.run_policy("ours", workload, backends, slots, {})
                count = fired[0] if a.patches else None
                runs[a.id].append({**dataclasses.asdict(run), "fired": count})
                took = f"{time.perf_counter() - started:6.0f}s {workload.name} {a.id}:"
                print(took, run, f"fired {count}", file=sys.stderr, flush=True)
        row = {"workload": workload.name, "fleet": f"{backends}x{slots}", "runs": runs}
        rows.append({**row, "ideal": replay.ideal_hit_rate(workload)})
    return rows


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def _cell(row: dict[str, Any], ablation: str) -> str:
    runs, base = row["runs"].get(ablation), row["runs"].get("baseline")
    if not runs:
        return "-"
    hit, ms = _mean(runs, "hit"), _mean(runs, "latency") * 1000
    if ablation == "baseline" or not base:
        hits = [r["hit"] for r in runs]
        return f"{hit:.4f} [{min(hits):.4f}-{max(hits):.4f}], {ms:.0f} ms"
    low, high = min(r["hit"] for r in base), max(r["hit"] for r in base)
    mark = "*" if not low <= hit <= high else ""
    fired = [r["fired"] for r in runs if r["fired"] is not None]
    count = f", {statistics.fmean(fired):.0f}x" if fired else ""
    return f"{hit:.4f} ({hit - _mean(base, 'hit'):+.4f}{mark}), {ms:.0f} ms{count}"


def print_table(result: dict[str, Any]) -> None:
    rows, ablations = result["rows"], result["ablations"]
    print(
        f"\npolicy ours, fake llama-servers ({result['machine']['machine']}, "
        f"{result['machine']['cpus']} cpus), commit {result['commit'][:7]}; per cell: mean "
        "token-weighted hit rate (delta against the baseline mean, * outside the baseline's "
        "min-max), mean request latency, decisions the patched rule changed per run (Nx); "
        "baseline: mean [min-max]. Runs: "
        + ", ".join(f"{a}: {len(rows[0]['runs'][a])}" for a in ("baseline", ablations[-1]["id"]))
    )
    header = ["ablation", "rule off", *(f"{r['workload']} {r['fleet']}" for r in rows)]
    print_markdown(
        header, ([a["id"], a["what"], *(_cell(r, a["id"]) for r in rows)] for a in ablations)
    )
    print("| ideal | infinite cache | " + " | ".join(f"{r['ideal']:.4f}" for r in rows) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=2, help="runs per ablation (rounds)")
    parser.add_argument("--baseline", type=int, help="baseline runs (default: max(2, repeat))")
    parser.add_argument("--only", nargs="*", default=WORKLOADS, help="workload names")
    parser.add_argument("--ablations", nargs="*", help="ablation ids (default: all)")
    parser.add_argument("--out", default="ablation", help="results stem under bench/results")
    parser.add_argument("--from-json", action="store_true", help="re-print the saved results")
    parser.add_argument("--backends", type=int, default=4, help="fleet of rows without a shape")
    parser.add_argument("--slots", type=int, default=4, help="slots of each of those backends")
    parser.add_argument("--chat", action="store_true", help="prompts as chat messages")
    parser.add_argument("--no-ram-cache", action="store_true", help="fakes without a RAM cache")
    parser.add_argument("--ram-tokens", type=int, help="bound each fake's RAM cache (and tell)")
    args = parser.parse_args()
    if args.from_json:
        print_table(load(args.out))
        return
    args.baseline = args.baseline or max(2, args.repeat)
    chosen = [a for a in ABLATIONS if a.id == "baseline" or a.id in (args.ablations or [a.id])]
    # the replay's defaults, as its main() sets them without options (but these)
    replay.CHAT, replay.RAM_CACHE, replay.IDLE_SAVES = args.chat, not args.no_ram_cache, True
    replay.RAM_TOKENS = args.ram_tokens
    replay.REPLICAS, replay.SHARD, replay.STREAM, replay.PROCESS = 1, False, False, False
    replay.PREFILL_S_PER_TOKEN, replay.DECODE_S_PER_TOKEN = 2e-5, 0.005
    replay.ROUTING.clear()
    rows = asyncio.run(run_rows(args, chosen))
    result = {
        "timing": {"prefill_s_per_token": 2e-5, "decode_s_per_token": 0.005},
        "fleet": {
            "chat": args.chat,
            "ram_cache": not args.no_ram_cache,
            "ram_tokens": args.ram_tokens,
        },
        "ablations": [
            {"id": a.id, "what": a.what, "routing": a.routing, "params": a.params} for a in chosen
        ],
        "rows": rows,
    }
    saved = save(args.out, result)
    print_table(load(str(saved)))  # with the commit and machine save added


if __name__ == "__main__":
    main()

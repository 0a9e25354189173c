"""What a freed slot costs the proxy while N requests wait: the waiters it asks again, and the time.

A fleet of 64 backends x 8 slots, every slot busy with a session's turn (about 1,500 tokens
under one of eight system prompts, as in ``bench.routing_cost``). N more requests wait,
each the next turn of a session whose slot is busy, so its routing waits for that slot.
Slots then free one at a time in random order (``--releases``). The scheduler
(``proxy.backends.scheduler``) asks waiters again with the routing decision
(``core.routing.decision.route``), mapped to the scheduler's answers as the router maps it.
A slot nobody takes goes to a new session. Each waiter served is replaced by the next turn
of another busy session, so N stays. Per N, the table gives the decisions one release made
(mean and max) and its time (p50 and mean). It gives them for this checkout and for each
other one named with ``--checkout NAME=DIR``, in one run; a checkout whose scheduler has no
index of waiters gets every wait as "any slot".

    python -m bench release_cost [--waiting 16 64 256] [--releases 200] [--checkout base=DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BACKENDS, SLOTS, KINDS = 64, 8, 8


async def measure(waiting: int, releases: int) -> dict[str, Any]:
    """One row: ``releases`` slots freed with ``waiting`` requests waiting."""
    from prometheus_client import CollectorRegistry

    from bench.routing_cost import conversation
    from proxy.backends.scheduler import Scheduler
    from proxy.config.sections import QueueSettings
    from proxy.core.prompt.fingerprint import Fingerprint, fingerprint_chat
    from proxy.core.routing.decision import route
    from proxy.core.routing.index import FleetIndex
    from proxy.core.routing.scoring import RoutingParams
    from proxy.core.server.fleet import (
        BackendPhase,
        Fleet,
        NoPlacement,
        Placement,
        Probe,
        SlotPhase,
        SlotProbe,
    )
    from proxy.metrics import ProxyMetrics
    from proxy.routing.tokenizer import TokenCounter

    try:
        from proxy.core.routing.wakes import Awaiting
    except ImportError:  # a checkout with no index of waiters
        Awaiting = None  # type: ignore[assignment,misc]
    rng, counter = random.Random(1), TokenCounter()
    kinds = [f"agent kind {k}: " for k in range(KINDS)]
    fleet = Fleet([f"b{i}" for i in range(BACKENDS)])
    turns: dict[tuple[int, int], Fingerprint] = {}  # each busy slot's session's next turn
    for b in range(BACKENDS):
        probe = Probe(BackendPhase.READY, tuple(SlotProbe(i, False, 0, -1) for i in range(SLOTS)))
        fleet.apply_probe(b, probe, now=0.0)
        for slot in fleet.backends[b].slots:
            body = conversation(1500, session=f"s{b}/{slot.id}", system=rng.choice(kinds))
            content = fingerprint_chat(body, counter.count)
            slot.phase, slot.pending, slot.last_used = SlotPhase.BUSY, content, rng.random() * 100
            body["messages"].append({"role": "user", "content": "next"})  # type: ignore[attr-defined]
            turns[(b, slot.id)] = fingerprint_chat(body, counter.count)
    settings = QueueSettings(max_waiting=waiting + 1, max_wait_seconds=3600.0)
    scheduler = Scheduler(fleet, settings, ProxyMetrics(CollectorRegistry()), lambda: 200.0)
    params, index, decisions = RoutingParams(), FleetIndex(), [0]

    def decider(fp: Fingerprint) -> Any:
        def decide() -> Any:
            decisions[0] += 1
            d = route(
                fp, fleet.backends, params, now=200.0, index=index, queued=scheduler.waiting()
            )
            if isinstance(d, NoPlacement) or d.placement is not None:
                return d if isinstance(d, NoPlacement) else d.placement
            wakes = getattr(d, "wakes", None)  # (as the router maps a decision to wait)
            if d.until is None and wakes is not None and Awaiting is not None:
                return Awaiting(wakes)
            return NoPlacement.BUSY

        return decide

    tasks: dict[asyncio.Task[Placement], tuple[int, int]] = {}  # each waiter's session

    def add_waiter() -> None:
        awaited = set(tasks.values())
        ref = rng.choice([r for r in turns if r not in awaited])
        tasks[asyncio.create_task(scheduler.acquire(decider(turns[ref]), turns[ref]))] = ref

    for _ in range(waiting):
        add_waiter()
    await asyncio.sleep(0)  # every waiter decides once, and waits
    counts, seconds = [], []
    for _ in range(releases):
        b, s = rng.choice(
            [r for r in turns if fleet.backends[r[0]].slots[r[1]].phase is SlotPhase.BUSY]
        )
        slot = fleet.backends[b].slots[s]
        before, started = decisions[0], time.perf_counter()
        scheduler.release(Placement(b, (s,), s), clean=True, content=slot.pending)
        seconds.append(time.perf_counter() - started)
        counts.append(decisions[0] - before)
        if slot.phase is SlotPhase.IDLE:  # nobody took it: a new session does
            fleet.claim(Placement(b, (s,), s), 200.0, slot.content)
        for _ in range(3):
            await asyncio.sleep(0)  # the waiters served return
        for task in [t for t in tasks if t.done()]:
            del tasks[task]
            add_waiter()
        await asyncio.sleep(0)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "waiting": waiting,
        "decisions_mean": statistics.mean(counts),
        "decisions_max": max(counts),
        "p50_ms": statistics.median(seconds) * 1000,
        "mean_ms": statistics.mean(seconds) * 1000,
    }


def _rows(source: str | None, waiting: list[int], releases: int) -> list[dict[str, Any]]:
    """The rows of one checkout: this one in a child process too, so each starts alike."""
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = source
    else:
        env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    args = [sys.executable, __file__, "--child", "--releases", str(releases)]
    out = subprocess.run(
        [*args, "--waiting", *map(str, waiting)], env=env, check=True, capture_output=True
    )
    return list(json.loads(out.stdout))


def main() -> None:
    from bench.paired_overhead import checkouts
    from bench.results_io import machine_line, print_markdown, save

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiting", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--releases", type=int, default=200)
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR")
    args = parser.parse_args()
    named = checkouts(args.checkout)
    results = {name: _rows(src, args.waiting, args.releases) for name, src in named.items()}
    print(f"{machine_line()}; {BACKENDS} x {SLOTS} slots, {args.releases} releases per row")
    print_markdown(
        [
            "checkout",
            "waiting",
            "decisions per release (mean / max)",
            "ms per release (p50 / mean)",
        ],
        [
            [
                name,
                str(r["waiting"]),
                f"{r['decisions_mean']:.1f} / {r['decisions_max']}",
                f"{r['p50_ms']:.2f} / {r['mean_ms']:.2f}",
            ]
            for name, rows in results.items()
            for r in rows
        ],
    )
    save("release_cost", {"checkouts": results})


def _child() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--waiting", type=int, nargs="+")
    parser.add_argument("--releases", type=int)
    args = parser.parse_args()
    rows = [asyncio.run(measure(n, args.releases)) for n in args.waiting]
    print(json.dumps(rows))


if __name__ == "__main__":
    if "--child" in sys.argv:
        sys.path[0] = os.environ["PYTHONPATH"].split(os.pathsep)[0]  # (not bench/ itself)
        _child()
    else:
        main()

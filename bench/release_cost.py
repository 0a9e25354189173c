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

``--holds``: the same fleet without a RAM cache, so a slot its session just left is held for
it (``core.routing.returns``, 2 s). Each round a slot no waiter waits for frees, a new session
arrives and finds every idle slot held, so it waits behind the hold; the hold then ends (the
scheduler's timer, called directly). The table gives what the hold's end costs instead.

    python -m bench release_cost [--waiting 16 64 256] [--releases 200] [--holds]
        [--checkout base=DIR]
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


HOLD = 2.0  # s: how long a slot its session left is held for it (``--holds``)


async def measure(waiting: int, releases: int, holds: bool = False) -> dict[str, Any]:
    """One row: ``releases`` slots freed with ``waiting`` requests waiting (``holds``: hold
    ends instead, module docstring)."""
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
        fleet.backends[b].ram = not holds
        for slot in fleet.backends[b].slots:
            body = conversation(1500, session=f"s{b}/{slot.id}", system=rng.choice(kinds))
            content = fingerprint_chat(body, counter.count)
            slot.phase, slot.pending, slot.last_used = SlotPhase.BUSY, content, rng.random() * 100
            body["messages"].append({"role": "user", "content": "next"})  # type: ignore[attr-defined]
            turns[(b, slot.id)] = fingerprint_chat(body, counter.count)
    settings = QueueSettings(max_waiting=waiting + 1, max_wait_seconds=3600.0)
    now = [200.0]
    scheduler = Scheduler(fleet, settings, ProxyMetrics(CollectorRegistry()), lambda: now[0])
    params, index, decisions = RoutingParams(), FleetIndex(), [0]
    behind: list[bool] = [False]  # the last decision waits behind a hold
    # a hold's end is the scheduler's timer, called here: no timer of its own runs
    ends_held = Awaiting is not None and "until" in getattr(Awaiting, "_fields", ())
    scheduler._arm = lambda when: None  # type: ignore[method-assign]  # (where it has one)
    scheduler.wake_at = lambda *args: None  # type: ignore[attr-defined]  # (where it has that)

    def decider(fp: Fingerprint) -> Any:
        def decide() -> Any:
            decisions[0] += 1
            d = route(
                fp,
                fleet.backends,
                params,
                now=now[0],
                index=index,
                queued=scheduler.waiting(),
                hold=HOLD if holds else 0.0,
            )
            if isinstance(d, NoPlacement) or d.placement is not None:
                return d if isinstance(d, NoPlacement) else d.placement
            wakes = getattr(d, "wakes", None)  # (as the router maps a decision to wait)
            behind[0] = d.until is not None
            if d.until is not None and ends_held:
                return Awaiting(None, d.until, d.wait_for)
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
    if holds:
        return await _hold_ends(
            fleet, scheduler, decider, turns, tasks, (decisions, behind), now, releases
        )
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


async def _hold_ends(
    fleet: Any,
    scheduler: Any,
    decider: Any,
    turns: dict[tuple[int, int], Any],
    tasks: dict[Any, tuple[int, int]],
    counted: tuple[list[int], list[bool]],
    now: list[float],
    rounds: int,
) -> dict[str, Any]:
    """``rounds`` slots freed for a newcomer (module docstring); each hold's end measured
    from the timer's call, where the newcomer waits behind the hold (some take another
    session's slot at once, or wait for a busy one)."""
    decisions, behind = counted
    from bench.routing_cost import conversation
    from proxy.core.prompt.fingerprint import fingerprint_chat
    from proxy.core.server.fleet import Placement, SlotPhase
    from proxy.routing.tokenizer import TokenCounter

    rng, counter, counts, seconds = random.Random(2), TokenCounter(), [], []
    for i in range(rounds):
        awaited = set(tasks.values())
        b, s = rng.choice(
            [
                r
                for r in turns
                if r not in awaited and fleet.backends[r[0]].slots[r[1]].phase is SlotPhase.BUSY
            ]
        )
        slot = fleet.backends[b].slots[s]
        scheduler.release(Placement(b, (s,), s), clean=True, content=slot.pending)
        body = conversation(1500, session=f"new{i}", system=f"agent kind {i % 8}: ")
        fp = fingerprint_chat(body, counter.count)
        newcomer = asyncio.create_task(scheduler.acquire(decider(fp), fp))
        await asyncio.sleep(0)  # it waits behind the hold (or took another session's slot)
        held = behind[0] and not newcomer.done()
        now[0] += 2 * HOLD  # the hold has ended
        before, started = decisions[0], time.perf_counter()
        scheduler._timer()
        if held:
            seconds.append(time.perf_counter() - started)
            counts.append(decisions[0] - before)
        await asyncio.sleep(0)
        if not newcomer.done():  # (it would have taken the slot: it goes)
            newcomer.cancel()
        if slot.phase is SlotPhase.IDLE:
            fleet.claim(Placement(b, (s,), s), now[0], slot.content)
        await asyncio.sleep(0)
    return {
        "waiting": len(tasks),
        "hold_ends": len(counts),
        "decisions_mean": statistics.mean(counts),
        "decisions_max": max(counts),
        "p50_ms": statistics.median(seconds) * 1000,
        "mean_ms": statistics.mean(seconds) * 1000,
    }


def _rows(
    source: str | None, waiting: list[int], releases: int, holds: bool
) -> list[dict[str, Any]]:
    """The rows of one checkout: this one in a child process too, so each starts alike."""
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = source
    else:
        env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    args = [sys.executable, __file__, "--child", "--releases", str(releases)]
    args += ["--holds"] if holds else []
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
    parser.add_argument("--holds", action="store_true", help="hold ends instead of releases")
    args = parser.parse_args()
    named = checkouts(args.checkout)
    results = {
        name: _rows(src, args.waiting, args.releases, args.holds) for name, src in named.items()
    }
    events = "hold ends" if args.holds else "releases"
    rounds = f"{args.releases} {'slots freed for a newcomer' if args.holds else 'releases'}"
    print(f"{machine_line()}; {BACKENDS} x {SLOTS} slots, {rounds} per row")
    print_markdown(
        [
            "checkout",
            "waiting",
            f"decisions per {events[:-1]} (mean / max)",
            f"ms per {events[:-1]} (p50 / mean)",
        ],
        [
            [
                name,
                str(r["waiting"]) + (f" ({r['hold_ends']} hold ends)" if args.holds else ""),
                f"{r['decisions_mean']:.1f} / {r['decisions_max']}",
                f"{r['p50_ms']:.2f} / {r['mean_ms']:.2f}",
            ]
            for name, rows in results.items()
            for r in rows
        ],
    )
    save("release_cost", {"events": events, "checkouts": results})


def _child() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--waiting", type=int, nargs="+")
    parser.add_argument("--releases", type=int)
    parser.add_argument("--holds", action="store_true")
    args = parser.parse_args()
    rows = [asyncio.run(measure(n, args.releases, args.holds)) for n in args.waiting]
    print(json.dumps(rows))


if __name__ == "__main__":
    if "--child" in sys.argv:
        sys.path[0] = os.environ["PYTHONPATH"].split(os.pathsep)[0]  # (not bench/ itself)
        _child()
    else:
        main()

"""What a cache_key changes: the traces replayed with each session id as ``prompt_cache_key``,
and without, side by side.

Every request of a session carries its trace session id as ``prompt_cache_key`` ("keyed") or
none ("unkeyed"); the proxy (its defaults) runs against a fresh 4 x 4 fake fleet per run, the
two alternating in rounds so that drift is shared. Reported: token-weighted hit rate, and for
the keyed runs the share of keyed requests whose mapped slot was reused ("reuse"), served
less than a hit ("unsafe"), busy, or passed over for another idle slot that scores higher
("outmatched"). The key decides ties and the label only, never against the score
(``core.routing.decision``), so the two hit rates should agree within the run-to-run spread.

    python -m bench.cache_key [--repeat N] [--only miniswe magagent taubench]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest

from bench.inproc import serve
from bench.replay import _fleet, _hit
from bench.results_io import print_markdown, save
from bench.workloads import Workload, lmcache
from proxy.config.settings import Settings
from testbed.probes import metric

OUTCOMES = ("reuse", "unsafe", "busy", "outmatched")
TRACES = ("miniswe", "magagent", "taubench")


async def _run(workload: Workload, keyed: bool) -> dict[str, float]:
    fakes = await _fleet(4, 4, None)
    registry = CollectorRegistry()
    settings = Settings.model_validate(
        {
            "backends": [f.url for f in fakes],
            "log_level": "WARNING",
            "queue": {"max_wait_seconds": 600},
        }
    )

    async def session(url: str, index: int, prompts: list[tuple[str, int]]) -> None:
        async with aiohttp.ClientSession() as client:
            for prompt, reply in prompts:
                body: dict[str, Any] = {"model": "fake-model", "prompt": prompt}
                body["max_tokens"] = reply
                if keyed:
                    body["prompt_cache_key"] = f"s{index}"
                async with client.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()

    try:
        async with serve(settings, registry) as url:
            await asyncio.gather(*(session(url, i, s) for i, s in enumerate(workload.sessions)))
        page = generate_latest(registry).decode()
        total = metric(page, "llama_cache_proxy_cache_key_total") or 1.0
        out = {"hit": _hit(fakes)[0]}
        for outcome in OUTCOMES:
            count = metric(page, "llama_cache_proxy_cache_key_total", outcome=outcome)
            out[outcome] = count / total
        return out
    finally:
        for fake in fakes:
            await fake.stop()


async def main_async(repeat: int, traces: list[str]) -> list[dict[str, Any]]:
    rows = []
    for workload in map(lmcache, traces):
        for round_ in range(repeat):
            for keyed in (True, False):
                row: dict[str, Any] = {"workload": workload.name, "keyed": keyed, "round": round_}
                row.update(await _run(workload, keyed))
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="runs of each (rounds)")
    parser.add_argument("--only", nargs="*", default=list(TRACES), choices=TRACES)
    args = parser.parse_args()
    rows = asyncio.run(main_async(args.repeat, args.only))
    save("cache_key", rows)
    table = []
    for name in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == name]
        keyed = [r for r in mine if r["keyed"]]
        unkeyed = [r for r in mine if not r["keyed"]]
        table.append(
            (
                name,
                " / ".join(f"{r['hit']:.4f}" for r in keyed),
                " / ".join(f"{r['hit']:.4f}" for r in unkeyed),
                *(f"{statistics.mean(r[o] for r in keyed):.2f}" for o in OUTCOMES),
            )
        )
    print_markdown(("workload", "keyed hit", "unkeyed hit", *OUTCOMES), table)


if __name__ == "__main__":
    main()

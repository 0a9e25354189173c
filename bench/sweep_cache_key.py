"""Sweep the cache_key thresholds on the traces: similarity 0.25/0.5/0.75/0.9 x 16/32/64 tokens.

Every request carries its trace session id as ``prompt_cache_key``; the proxy (prefix routing
on) runs against a fresh 4 x 4 fake fleet per setting. Reported: token-weighted hit rate and
the share of keyed requests whose mapped slot was reused ("reuse"), refused as unrelated
("unsafe"), busy, or passed over for another idle slot that scores higher ("outmatched").

    python -m bench.sweep_cache_key
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest

from bench.inproc import serve
from bench.replay import _fleet, _hit
from bench.results_io import print_markdown, save
from bench.workloads import Workload, lmcache
from proxy.config.settings import Settings
from testbed.probes import metric

SIMILARITY = (0.25, 0.5, 0.75, 0.9)
MIN_PREFIX = (16, 32, 64)
OUTCOMES = ("reuse", "unsafe", "busy", "outmatched")


async def _run(workload: Workload, similarity: float, min_prefix: int) -> dict[str, float]:
    fakes = await _fleet(4, 4, None)
    registry = CollectorRegistry()
    settings = Settings.model_validate(
        {
            "backends": [f.url for f in fakes],
            "log_level": "WARNING",
            "queue": {"max_wait_seconds": 600},
            "routing": {
                "slot_cache_key_similarity": similarity,
                "slot_cache_key_min_prefix": min_prefix,
            },
        }
    )

    async def session(url: str, index: int, prompts: list[tuple[str, int]]) -> None:
        async with aiohttp.ClientSession() as client:
            for prompt, reply in prompts:
                body = {
                    "model": "fake-model",
                    "prompt": prompt,
                    "max_tokens": reply,
                    "prompt_cache_key": f"s{index}",
                }
                async with client.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()

    try:
        async with serve(settings, registry) as url:
            await asyncio.gather(*(session(url, i, s) for i, s in enumerate(workload.sessions)))
        page = generate_latest(registry).decode()
        keyed = metric(page, "llama_cache_proxy_cache_key_total") or 1.0
        out = {"hit": _hit(fakes)[0]}
        for outcome in OUTCOMES:
            out[outcome] = (
                metric(page, "llama_cache_proxy_cache_key_total", outcome=outcome) / keyed
            )
        return out
    finally:
        for fake in fakes:
            await fake.stop()


async def main_async() -> list[dict[str, Any]]:
    rows = []
    for workload in (lmcache("miniswe"), lmcache("magagent"), lmcache("taubench")):
        for similarity, min_prefix in itertools.product(SIMILARITY, MIN_PREFIX):
            result = await _run(workload, similarity, min_prefix)
            row = {
                "workload": workload.name,
                "similarity": similarity,
                "min_prefix": min_prefix,
                **result,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    rows = asyncio.run(main_async())
    save("sweep_cache_key", rows)
    header = ("workload", "similarity", "min prefix", "hit rate", "keyed reuse", *OUTCOMES[1:])
    print_markdown(
        header,
        (
            (
                r["workload"],
                r["similarity"],
                r["min_prefix"],
                f"{r['hit']:.3f}",
                *(f"{r.get(outcome, 0.0):.2f}" for outcome in OUTCOMES),
            )
            for r in rows
        ),
    )


if __name__ == "__main__":
    main()

"""Readings of a running proxy: a metric from its ``/metrics`` text, its ``Server-Timing``
header, and a wait until its replicas have listed each other; and a llama-server's metric."""

from __future__ import annotations

import asyncio
import urllib.request

import aiohttp


async def until_listed(urls: list[str]) -> None:
    """Until every proxy replica at ``urls`` has read every other's heartbeat (and so knows
    each backend's home)."""
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            live = []
            for url in urls:
                async with session.get(url + "/metrics") as resp:
                    live.append(metric(await resp.text(), "llama_cache_proxy_replicas_live"))
            if all(n == len(urls) for n in live):
                return
            await asyncio.sleep(0.1)
    raise AssertionError("the replicas never listed each other")


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def server_metric(url: str, name: str) -> float:
    """A metric of the llama-server at ``url`` (started with ``--metrics``), read now."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return metric(resp.read().decode(), name)


def server_timing(header: str) -> dict[str, float]:
    """A ``Server-Timing`` header as {name: milliseconds}."""
    parts = (part.strip().split(";dur=") for part in header.split(","))
    return {name: float(ms) for name, ms in parts}

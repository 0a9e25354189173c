"""What llama-server's idle-slot saves cost a request's start (real llama-server, CPU).

With ``--cache-idle-slots`` (the default), every task that starts first copies each idle
slot's KV into the host-RAM prompt cache, unless the cache already holds that content. In
an agent fleet a slot's content changes with every request it serves, so a request usually
starts by copying the KV of the slot that finished last. ``--no-cache-idle-slots`` skips
that (the proxy is told with ``backends[].cache_idle_slots: false``; docs/benchmarks.md, "Idle-slot
saves").

Two llama-servers side by side, one per mode, 4 slots each. Per round and server: a new
``--tokens``-token prompt fills slot 1 (its content changes, as after a session's turn);
then a request that repeats slot 0's prompt (fully cached: about one token to compute) is
timed from send to reply. With idle saves it first copies slot 1's new KV into RAM. The two
servers alternate within each round, so both see the same machine load.

    python -m bench.idle_saves [--rounds 8] [--tokens 1800]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import aiohttp

from bench.results_io import measured, print_markdown
from testbed.stack import LlamaServer, require_real_stack

MODES = {"idle saves (default)": (), "--no-cache-idle-slots": ("--no-cache-idle-slots",)}


def text(seed: int, words: int) -> str:
    return " ".join(f"w{seed}x{i % 97}" for i in range(words))


async def complete(
    http: aiohttp.ClientSession, url: str, prompt: str, slot: int
) -> tuple[float, dict[str, Any]]:
    """Seconds from send to reply, and the reply's ``timings``."""
    body = {"prompt": prompt, "n_predict": 1, "id_slot": slot, "cache_prompt": True}
    started = time.perf_counter()
    async with http.post(url + "/completion", json=body) as resp:
        assert resp.status == 200, await resp.text()
        reply = await resp.json()
    return time.perf_counter() - started, reply.get("timings", {})


async def words_for(http: aiohttp.ClientSession, url: str, tokens: int) -> int:
    """How many words of ``text`` make about ``tokens`` of this model's tokens."""
    async with http.post(url + "/tokenize", json={"content": text(100, 100)}) as resp:
        per_word = len((await resp.json())["tokens"]) / 100
    return int(tokens / per_word)


async def run(rounds: int, tokens: int) -> dict[str, Any]:
    binary, model = require_real_stack()
    servers = {
        mode: LlamaServer(binary, model, slots=4, ctx_per_slot=4096, extra=extra).start()
        for mode, extra in MODES.items()
    }
    timed: dict[str, list[float]] = {mode: [] for mode in MODES}
    fills: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            words = await words_for(http, servers[next(iter(MODES))].url, tokens)
            anchor = text(1, 200)
            for server in servers.values():
                await complete(http, server.url, anchor, 0)  # slot 0 holds the repeated one
            for r in range(rounds + 1):  # round 0 warms up, not counted
                for mode, server in servers.items():
                    filled, _ = await complete(http, server.url, text(100 + r, words), 1)
                    seconds, _ = await complete(http, server.url, anchor, 0)
                    if r:
                        fills[mode].append(filled)
                        timed[mode].append(seconds)
    finally:
        for server in servers.values():
            server.cleanup()
    return {"tokens": tokens, "rounds": rounds, "timed": timed, "fills": fills}


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\nreal llama-server (SmolLM2-135M Q4_1, CPU {platform.machine()}, 2 threads, 4 slots); "
        f"slot 1 refilled with {result['tokens']} tokens before each timed request; "
        f"{result['rounds']} rounds, median (min-max)"
    )
    base = statistics.median(result["timed"]["--no-cache-idle-slots"])
    print_markdown(
        ("server", "cached request (ms)", "vs without idle saves", "the fill (s)"),
        (
            (
                mode,
                f"{statistics.median(v) * 1000:.1f} ({min(v) * 1000:.1f}-{max(v) * 1000:.1f})",
                f"{statistics.median(v) / base:.2f}x",
                f"{statistics.median(result['fills'][mode]):.2f}",
            )
            for mode, v in result["timed"].items()
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1800)
    parser.add_argument("--from-json", action="store_true")
    args = parser.parse_args()
    print_table(measured("idle_saves", args.from_json, lambda: run(args.rounds, args.tokens)))


if __name__ == "__main__":
    main()

"""Time to first token of a ~2.5k-token agent prompt: cold vs restored from disk after a
backend restart, side by side in one run (real llama-server, SmolLM2-135M, CPU).

Setup: one llama-server (2 slots, ``--slot-save-path``) behind the proxy (disk tier ``auto``,
the save directory shared). Two sessions of one agent teach the window its prompt shape and
the second one saves the stable prefix (system prompt and tool descriptions). Then, per
repetition: the backend restarts and a new session is sent with ``prefix_cache: off`` (cold:
full prefill); the backend restarts again and another new session is sent with the default
policy (restored: the snapshot is loaded, only the session's own tail is prefilled). A third
row sends one more new session right after, with no restart (the prefix is then in a live
slot and on disk; the route header says which served it).

    python -m bench.disk_ttft [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from typing import Any

import aiohttp

from bench.inproc import serve
from bench.results_io import measured, print_markdown
from proxy.config.settings import Settings
from testbed.stack import LlamaServer, require_real_stack

TOOLS = ["read_file", "write_file", "run_shell", "search_code", "open_url", "list_dir", "git"]


def agent_system() -> str:
    """An OpenClaw-like system block: identity, rules, and tool descriptions (~2.4k tokens)."""
    parts = ["You are Claw, a coding agent working in the user's repository."]
    parts += [
        f"Rule {i}: before change {i}, read the relevant files, keep the diff small, "
        f"run the tests, and report what you measured in one short paragraph."
        for i in range(60)
    ]
    for tool in TOOLS:
        parts.append(
            f"Tool {tool}: call it with a JSON object. Arguments: path (string), "
            f"content (string, optional), timeout_seconds (integer, default 30). "
            f"Returns the {tool} result as text; errors are returned, never raised."
        )
    return "\n".join(parts)


def request(session: int, system: str, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Task {session}: fix failing test number {session}."},
        ],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        **extra,
    }


async def ttft(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, str]:
    """Seconds to the first streamed chunk, and the route the proxy reported."""
    started = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        first = None
        async for _ in resp.content:
            if first is None:
                first = time.perf_counter() - started
        return first or 0.0, resp.headers.get("X-Cache-Route", "")


async def restart(server: LlamaServer, http: aiohttp.ClientSession, url: str) -> None:
    server.stop()
    server.start()
    await asyncio.sleep(0.6)  # the proxy's prober sees the restart
    for _ in range(100):
        async with http.get(url + "/readyz") as resp:
            if resp.status == 200:
                return
        await asyncio.sleep(0.1)


async def run(reps: int) -> dict[str, Any]:
    binary, model = require_real_stack()
    server = LlamaServer(binary, model, slots=2, ctx_per_slot=4096).start()
    settings = Settings.model_validate(
        {
            "backends": [server.url],
            "health": {"interval_seconds": 0.2},
            "disk": {"slot_save_dir": str(server.save_dir), "min_tokens": 256},
            "log_level": "WARNING",
        }
    )
    system = agent_system()
    rows: dict[str, list[float]] = {"cold": [], "restored": [], "warm": [], "save": []}
    routes: dict[str, list[str]] = {k: [] for k in rows}
    try:
        async with (
            serve(settings) as url,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http,
        ):
            async with http.post(
                server.url + "/tokenize", json={"content": system, "add_special": True}
            ) as resp:
                prompt_tokens = len((await resp.json())["tokens"])
            await ttft(http, url, request(0, system))  # the window learns the prompt shape
            seconds, route = await ttft(http, url, request(1, system))  # scoped save path
            rows["save"].append(seconds)
            routes["save"].append(route)
            for rep in range(reps):
                await restart(server, http, url)
                off = {"prefix_cache": {"scope": "off"}}
                seconds, route = await ttft(http, url, request(10 + rep, system, **off))
                rows["cold"].append(seconds)
                routes["cold"].append(route)
                await restart(server, http, url)
                seconds, route = await ttft(http, url, request(20 + rep, system))
                rows["restored"].append(seconds)
                routes["restored"].append(route)
                seconds, route = await ttft(http, url, request(30 + rep, system))
                rows["warm"].append(seconds)
                routes["warm"].append(route)
    finally:
        server.cleanup()
    return {"system_tokens": prompt_tokens, "seconds": rows, "routes": routes}


def print_table(result: dict[str, Any]) -> None:
    med = {k: statistics.median(v) for k, v in result["seconds"].items() if v}
    print(
        f"\nreal llama-server (SmolLM2-135M Q4_1, CPU {platform.machine()}, 2 threads); "
        f"agent prompt: {result['system_tokens']} shared tokens + a short task; "
        f"median of {len(result['seconds']['cold'])} runs"
    )
    labels = [
        ("cold", "cold (after restart, disk off)"),
        ("restored", "restored from disk (after restart)"),
        ("warm", "one more new session right after (no restart)"),
        ("save", "scoped save path (prefill + save, once)"),
    ]
    print_markdown(
        ("request", "TTFT (s)", "vs cold", "route"),
        (
            (
                label,
                f"{med[name]:.3f}",
                f"{med[name] / med['cold']:.1%}",
                ",".join(sorted(set(result["routes"][name]))),
            )
            for name, label in labels
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--from-json", action="store_true")
    args = parser.parse_args()
    print_table(measured("disk_ttft", args.from_json, lambda: run(args.reps)))


if __name__ == "__main__":
    main()

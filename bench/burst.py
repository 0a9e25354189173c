"""New sessions arriving together with one long system prompt, side by side in one run.

An agent framework that spawns several sub-agents, or a fleet of OpenClaw agents restarted
at once, sends N new conversations whose first ~2k tokens (system prompt and tools) are the
same, at the same moment. One fake llama-server (``testbed/fake_llama.py``: prefill serialized
at ``--prefill-ms`` per token, decoding in parallel at ``--gen-ms`` per token, slot
save/restore into a shared directory) with N slots; per policy, two waves of N new sessions
(the second finds the prefix in every slot):

- ``direct``: straight to the server, which picks the slot itself (llama-server's LCP
  similarity, else least recently used);
- ``ours``: through the proxy, disk tier off;
- ``ours-disk``: through the proxy, disk tier on its default ``auto``.

The table gives per wave the wall time until the last response, the mean request latency
and the prompt tokens the server computed.

    python -m bench.burst [--sessions 4] [--system-words 2000] [--prefill-ms 0.5] [--gen-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.inproc import serve
from bench.results_io import print_markdown, save
from proxy.config.settings import Settings
from testbed.fake_llama import FakeLlamaServer


def system_prompt(words: int) -> str:
    return "You are a careful coding agent. " + " ".join(
        f"rule{i} applies to tool{i % 7}." for i in range(words // 4)
    )


async def wave(url: str, system: str, sessions: int, index: int) -> tuple[float, float]:
    """(wall seconds, mean latency) of ``sessions`` new chats sent at once."""

    async def one(session: aiohttp.ClientSession, i: int) -> float:
        user = f"wave {index} agent {i}: fix bug {i}"
        body = {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 20,
        }
        start = time.monotonic()
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
            assert resp.status == 200, resp.status
        return time.monotonic() - start

    async with aiohttp.ClientSession() as session:
        start = time.monotonic()
        latencies = await asyncio.gather(*(one(session, i) for i in range(sessions)))
        return time.monotonic() - start, statistics.mean(latencies)


async def run(policy: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    directory = Path(tempfile.mkdtemp(prefix="burst-"))
    fake = FakeLlamaServer(
        n_slots=args.sessions,
        n_ctx=16 * args.system_words,
        save_dir=directory,
        prompt_s_per_token=args.prefill_ms / 1000,
        gen_s_per_token=args.gen_ms / 1000,
    )
    await fake.start(0)
    scope = "auto" if policy == "ours-disk" else "off"
    settings = Settings.model_validate(
        {
            "backends": [fake.url],
            "disk": {"slot_save_dir": str(directory), "prefix_cache": scope},
            "queue": {"max_wait_seconds": 120},
        }
    )
    system, rows = system_prompt(args.system_words), []
    try:
        async with serve(settings) as proxy_url:
            url = fake.url if policy == "direct" else proxy_url
            for index in range(2):
                before = fake.tokens_processed
                wall, latency = await wave(url, system, args.sessions, index)
                computed = fake.tokens_processed - before
                rows.append(
                    {
                        "policy": policy,
                        "wave": index + 1,
                        "wall": wall,
                        "latency": latency,
                        "computed": computed,
                    }
                )
    finally:
        await fake.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=2000)
    parser.add_argument("--prefill-ms", type=float, default=0.5, help="per prompt token")
    parser.add_argument("--gen-ms", type=float, default=20.0, help="per generated token")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for policy in ("direct", "ours", "ours-disk"):
        rows += asyncio.run(run(policy, args))
    save("burst", rows)
    print(f"machine: {platform.machine()}, {platform.python_version()}; {vars(args)}")
    print_markdown(
        ["policy", "wave", "wall s", "mean latency s", "prompt tokens computed"],
        (
            [r["policy"], r["wave"], f"{r['wall']:.2f}", f"{r['latency']:.2f}", r["computed"]]
            for r in rows
        ),
    )


if __name__ == "__main__":
    main()

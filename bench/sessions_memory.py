"""The proxy's memory with many tracked sessions.

Processes on loopback: one fake llama-server (8 slots, zero service time), the proxy
(``python -m proxy serve``, defaults, in-memory state) and this load generator. Each session
sends two turns of an agent-shaped chat: its own ~400-token system prompt and a first user
message carrying its session id (``X-Session-Id``, so it also gets a cache_key affinity),
then the same with the reply and a second message. Every session is new, so the proxy tracks
each one: affinities, the recent-request windows, the return tracker, the RAM-cache model
and the token counts of every text it saw. The proxy's resident memory (``VmRSS``) and peak
(``VmHWM``) are read from ``/proc`` after each step of sessions.

    python -m bench.sessions_memory [--sessions 10000] [--step 2500] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp

from bench.results_io import machine_line, print_markdown, save
from testbed.stack import fake_command, free_port, wait_http

SLOTS = 8


def _status(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of ``pid`` in MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) // 1024
    return out


def turn(session: int, second: bool) -> dict[str, Any]:
    system = f"You are agent {session}. " + " ".join(f"rule{session}x{i}" for i in range(400))
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"session {session}: list the files"},
    ]
    if second:
        messages += [
            {"role": "assistant", "content": "README.md proxy tests"},
            {"role": "user", "content": "open README.md"},
        ]
    return {"model": "fake-model", "messages": messages, "max_tokens": 4}


async def _sessions(url: str, first: int, count: int, concurrency: int) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for session in range(first, first + count):
        queue.put_nowait(session)

    async def worker(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            session = queue.get_nowait()
            for second in (False, True):
                headers = {"X-Session-Id": f"s{session}"}
                body = turn(session, second)
                async with http.post(url, json=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise SystemExit(f"status {resp.status}")

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))


def run(sessions: int, step: int, concurrency: int) -> list[dict[str, int]]:
    fake_port, port = free_port(), free_port()
    fake = subprocess.Popen(
        fake_command(fake_port, SLOTS),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    args = ["--backend", f"http://127.0.0.1:{fake_port}", "--listen", f"127.0.0.1:{port}"]
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    rows = []
    try:
        wait_http(f"http://127.0.0.1:{fake_port}/health", 30, fake)
        wait_http(f"http://127.0.0.1:{port}/readyz", 30, proxy)
        rows.append({"sessions": 0, **_status(proxy.pid)})
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        for done in range(0, sessions, step):
            asyncio.run(_sessions(url, done, min(step, sessions - done), concurrency))
            rows.append({"sessions": min(done + step, sessions), **_status(proxy.pid)})
            print(rows[-1], flush=True)
    finally:
        for proc in (proxy, fake):
            proc.terminate()
            proc.wait(10)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--step", type=int, default=2500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", default="sessions_memory")
    args = parser.parse_args()
    rows = run(args.sessions, args.step, args.concurrency)
    print(machine_line())
    print_markdown(
        ("sessions tracked", "proxy RSS MB", "proxy peak RSS MB"),
        [(r["sessions"], r["VmRSS"], r["VmHWM"]) for r in rows],
    )
    save(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

"""OpenClaw's default profile end to end on a sliding-window model: real `openclaw agent
--local` turns through the proxy to a real llama-server running Gemma 3 270M (32k context).
The default profile (system prompt, 12 tools, a transient carrier message the next turn
drops) is about 12k tokens, too large for SmolLM2's context.

Two sessions interleaved on one slot (a, b, a, b, a), the server run with ``--swa-full`` and
no RAM cache, the proxy's disk tier on: each returning turn finds the slot holding the other
session, is served from its own snapshot, restored, not re-prefilled, and reuses at least
99 % of its session's previous prompt (all of it but the carrier, which the next turn drops).

Per turn, (prompt, cached) tokens come from the proxy's metrics. OpenClaw is installed as in
``test_real_openclaw`` (skipped, loudly, only when the npm registry cannot be reached).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from testbed.probes import metric
from testbed.stack import ProxyProcess
from tests.real.test_real_openclaw import OPENCLAW, configure, install, scrape

READ_SECONDS = {"LLAMA_CACHE_PROXY_TIMEOUTS__READ_SECONDS": "600"}


class Turns:
    """``openclaw agent --local`` turns through one proxy, each measured from its metrics;
    each session with its own OpenClaw home (``envs``): OpenClaw's session-store maintenance
    can fail a turn when another session's writes changed the store under it."""

    def __init__(self, proxy: ProxyProcess, envs: dict[str, dict[str, str]]) -> None:
        self.proxy, self.envs, self.seen = proxy, envs, (0.0, 0.0)

    def run(self, session: str, message: str) -> tuple[float, float]:
        """One turn of ``session``: its (prompt, cached) tokens."""
        done = subprocess.run(
            [str(OPENCLAW), "agent", "--local", "--agent", "main", "--session-id", session,
             "--message", message, "--json", "--timeout", "600"],
            env=self.envs[session], capture_output=True, text=True, timeout=700,
        )  # fmt: skip
        assert done.returncode == 0, (done.stdout[-1000:], done.stderr[-2000:])
        page = scrape(self.proxy)
        prompt = metric(page, "llama_cache_proxy_prompt_tokens_total")
        cached = metric(page, "llama_cache_proxy_cached_tokens_total")
        turn = (prompt - self.seen[0], cached - self.seen[1])
        self.seen = (prompt, cached)
        print(f"openclaw on gemma, {session}: {turn[1]:.0f} of {turn[0]:.0f} cached")
        return turn


@pytest.mark.timeout(900)  # five OpenClaw turns of 12k-token prompts: minutes on a busy CPU
def test_openclaw_sessions_sharing_one_slot_come_back_from_their_snapshots(
    gemma_servers: Any,
) -> None:
    install()
    server = gemma_servers(swa_full=True, slots=1, ctx_per_slot=32768, extra=("--cache-ram", "0"))
    disk = {
        "LLAMA_CACHE_PROXY_DISK__SLOT_SAVE_DIR": str(server.save_dir),
        "LLAMA_CACHE_PROXY_DISK__PREFIX_CACHE": "auto",
    }
    proxy = ProxyProcess([server.url], env={**READ_SECONDS, **disk}, backend={"ram_cache": False})
    proxy.start()
    home = Path(tempfile.mkdtemp(prefix="openclaw-"))
    try:
        envs = {s: configure(home / s, proxy.url, cache_key=False, minimal=False) for s in "ab"}
        turns = Turns(proxy, envs)
        previous = {s: turns.run(s, "Say hello.")[0] for s in ("a", "b")}
        for session, message in (("a", "Say goodbye."), ("b", "Say goodbye."), ("a", "Thanks.")):
            prompt, cached = turns.run(session, message)  # the slot holds the other session
            assert prompt > 8000  # the default system prompt and 12 tools
            assert cached >= 0.99 * previous[session], (session, cached, previous[session])
            previous[session] = prompt
        page = scrape(proxy)
        assert metric(page, "llama_cache_proxy_disk_events_total", event="restore") >= 3
    finally:
        proxy.stop()
        shutil.rmtree(home, ignore_errors=True)

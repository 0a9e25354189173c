"""Agent sessions sharing one long system prompt, against real llama-servers (SmolLM2-135M).

Each session's turn is its previous messages, the previous reply as returned and a new short
user message; sessions are interleaved (s0t0 s1t0 s2t0 s0t1 ...) and outnumber the slots, so
every returning turn finds its slot overwritten by another session sharing only the system
prompt. The returning-turn hit (Σ cache_n / Σ prompt tokens over turns 2-4, from the
responses' ``timings``) is compared with the ideal (each returning turn reusing its own
previous prompt and reply: the previous turn's prompt and completion tokens, capped at the
prompt) and with the same sequence sent straight to llama-server (a session per backend,
fixed). The servers run as the README recommends: explicit ``-np``, ``--slot-save-path`` (the
proxy told the directory), ``--metrics``, RAM cache at its default. Run with ``-s`` to read
the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.app import SCHEDULER
from testbed.agents import Turn, run_agents
from testbed.probes import metric
from testbed.stack import LlamaServer
from tests.real.test_real_swa import probed


@dataclass(frozen=True)
class Score:
    hit: float
    ideal: float
    predicted_ok: float  # share of returning turns predicted within 10 % of cache_n

    def __str__(self) -> str:
        return f"hit {self.hit:.3f}, ideal {self.ideal:.3f}, predictions ok {self.predicted_ok:.2f}"


def score(turns: list[Turn]) -> Score:
    last: dict[Any, Any] = {}
    cached = ideal = total = ok = 0
    returning = [x for x in turns if x.turn > 0]
    for x in turns:
        if x.turn > 0:
            prev = last[x.session]
            cached += x.cached
            total += x.prompt
            ideal += min(prev.prompt + prev.completion, x.prompt - 1)
            if x.predicted is not None and abs(x.predicted - x.cached) <= 0.1 * max(x.cached, 1):
                ok += 1
        last[x.session] = x
    return Score(cached / total, ideal / total, ok / len(returning))


def report(label: str, turns: list[Turn]) -> Score:
    result = score(turns)
    print(f"\n{label}: {result}")
    for x in turns:
        print(f"  s{x.session}t{x.turn}: cache_n {x.cached} of {x.prompt}, predicted {x.predicted}")
    return result


async def straight(servers: list[LlamaServer], sessions: int) -> list[Turn]:
    """The sequence sent to the servers themselves, session ``s`` to server ``s % n``."""
    async with aiohttp.ClientSession() as http:

        async def send(s: int, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
            url = servers[s % len(servers)].url + "/v1/chat/completions"
            async with http.post(url, json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json(), resp.headers

        return await run_agents(send, sessions)


async def proxied(proxy: Any, servers: list[LlamaServer], sessions: int) -> list[Turn]:
    """The sequence through the proxy with its defaults, told the shared save directory;
    each backend's reuse rule probed (``kv_reuse: auto``, the default) before the first
    turn."""
    backends = [{"url": server.url, "kv_reuse": "auto"} for server in servers]
    client = await proxy(backends, disk={"slot_save_dir": str(servers[0].save_dir)})
    for backend in client.server.app[SCHEDULER].fleet.backends:
        await probed(backend)

    async def send(s: int, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200, await resp.text()
        return await resp.json(), resp.headers

    turns = await run_agents(send, sessions)
    page = await (await client.get("/metrics")).text()
    counts = {
        "primers": metric(page, "llama_cache_proxy_ram_primers_total", outcome="sent"),
        "parks": metric(page, "llama_cache_proxy_disk_saves_total", kind="park"),
        "restores": metric(page, "llama_cache_proxy_disk_events_total", event="restore"),
    }
    print("\nthrough the proxy: " + ", ".join(f"{k} {v:.0f}" for k, v in counts.items()))
    return turns


def shared_servers(llama_servers: Any, count: int) -> list[LlamaServer]:
    """``count`` servers of 2 slots sharing one ``--slot-save-path``."""
    first = llama_servers(slots=2, ctx_per_slot=4096)
    more = {"slots": 2, "ctx_per_slot": 4096, "save_dir": first.save_dir}
    return [first, *(llama_servers(**more) for _ in range(count - 1))]


async def compare(
    llama_servers: Any, proxy: Any, backends: int, sessions: int, alone: bool = True
) -> None:
    """The sequence through the proxy to fresh servers reaches 0.9 of the ideal, predicting
    ``cache_n``; with ``alone``, first straight to fresh servers, which it beats."""
    fleet = f"{backends}x2"
    turns = await proxied(proxy, shared_servers(llama_servers, backends), sessions)
    through = report(f"{fleet} through the proxy", turns)
    if alone:
        direct = report(
            f"{fleet} straight to llama-server",
            await straight(shared_servers(llama_servers, backends), sessions),
        )
        assert direct.hit < through.hit
    assert through.hit >= 0.9 * through.ideal, through
    assert through.predicted_ok >= 0.9, through


async def test_three_agents_on_one_backend_reuse_their_own_turns(
    llama_servers: Any, proxy: Any
) -> None:
    await compare(llama_servers, proxy, backends=1, sessions=3)


async def test_six_agents_on_two_backends_reuse_their_own_turns(
    llama_servers: Any, proxy: Any
) -> None:
    # llama-server alone does here what it does on one backend (each session stays on one),
    # measured by the test above
    await compare(llama_servers, proxy, backends=2, sessions=6, alone=False)


async def test_three_agents_on_one_gemma_backend_with_swa_full(
    gemma_servers: Any, proxy: Any
) -> None:
    """The same on a sliding-window model (Gemma 3 270M) run with ``--swa-full``, whose rule
    the proxy probes (a slot rolls back to any prefix): 0.9 of the ideal, predictions within
    10 % (without ``--swa-full``: the next test)."""
    servers = [gemma_servers(swa_full=True, slots=2, ctx_per_slot=4096)]
    through = report("gemma --swa-full 1x2 through the proxy", await proxied(proxy, servers, 3))
    assert through.predicted_ok >= 0.9, through
    assert through.hit >= 0.9 * through.ideal, through


async def test_three_agents_on_one_gemma_backend_without_swa_full(
    gemma_servers: Any, proxy: Any
) -> None:
    """Without ``--swa-full`` a slot is reused only as an exact extension or up to a
    checkpoint, and a disk snapshot would not be reused at all. The server saves each idle
    slot to its RAM cache (with its checkpoints), but a returning turn pinned to a slot
    holding another session keeps over half of it (the shared system prompt), so the server
    does not consult that cache: llama-server alone reuses the system prompt's checkpoint.
    The proxy, its rule probed (exact), sends a primer first, so the server parks the slot's
    session and loads the returning one: 0.9 of the ideal, ``cache_n`` predicted within
    10 %, and nothing saved to disk."""
    servers = [gemma_servers(slots=2, ctx_per_slot=4096)]
    through = report("gemma 1x2 through the proxy", await proxied(proxy, servers, 3))
    alone = report(
        "gemma 1x2 straight to llama-server",
        await straight([gemma_servers(slots=2, ctx_per_slot=4096)], 3),
    )
    assert through.hit > alone.hit, (through, alone)
    assert through.hit >= 0.9 * through.ideal, through
    assert through.predicted_ok >= 0.9, through
    assert [f.name for f in servers[0].save_dir.iterdir()] == ["server.log"]

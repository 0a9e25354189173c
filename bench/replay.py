"""Trace replay: token-weighted prompt-cache hit rate of routing policies, side by side.

Each policy gets a fresh fleet of fake llama-servers (``testbed/fake_llama.py``: real slot
LCP semantics and the host-RAM prompt cache) and the same workload: every session runs its
prompts one after another, all sessions at once. The hit rate is read from the backends'
own counters (cached / prompt tokens), so every router is measured the same way.

Policies: ``ideal`` (infinite cache: the longest prefix any earlier prompt had, computed
offline), ``round-robin`` (backends in turn, llama-server picks the slot), ``ours`` (this
proxy, disk tier off), ``ours-lru`` (this proxy without prefix routing), ``ours-disk`` (this
proxy with the disk tier on its default ``auto``, the fakes saving to one shared directory;
``ours-disk-nopark`` without parking), and the peer routers in ``bench/peers.py`` when
installed, each with its cache-aware policy (``sglang-router``) and its session policy
(``sglang-router:manual``: those requests carry the session id in the router's header).
``ours-NAME`` (with ``--checkout NAME=DIR``: the proxy of the checkout DIR, out of process, to
compare commits in one run). ``--chat`` sends each prompt as chat messages
(``workloads.chat_body``) instead of a raw completion prompt: the disk tier's scoped snapshots
need message boundaries.

    python -m bench.replay [--backends 4] [--slots 4] [--peers] [--repeat N]

With ``--replicas N`` ours runs as N proxies sharing one redis-server (``bench.replicas``),
each request sent to the next replica in turn, so a session's turns alternate replicas;
``--shard`` instead gives each replica its own backends and a session's turns to one
replica (a diagnostic: each slot scheduled by one replica, ``bench.replicas``). The
replicas forward each request to its backend's home replica (``proxy.http.forwarding``); policy
``ours-local`` runs them with ``replica_url: off`` (each routes what it receives), side by side.

With ``--repeat N`` every policy runs N times per workload (in rounds, each on a fresh
fleet) and the table shows means; the JSON keeps each run's hit rate (``<policy>_runs``).

Besides the hit rate, prefill tokens computed and wall time, each cell shows the mean request
latency as the client saw it (send to the reply's end, or to ``[DONE]`` when streaming): a
router can raise the hit rate by queueing requests behind a slot that holds their prefix, and
the latency is where that shows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import itertools
import json
import logging
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.http_exceptions import BadHttpMessage

from bench.inproc import serve
from bench.outproc import serve_process
from bench.peers import SESSION_HEADERS
from bench.plots import plot_replay, policy_columns
from bench.replicas import serve_replicas, serve_shards
from bench.results_io import latest, load, print_markdown, rows_of, save
from bench.workloads import Workload, chat_body, lmcache, mooncake
from proxy.config.settings import Settings
from testbed.fake_llama import FakeLlamaServer, tokenize

Send = Callable[[aiohttp.ClientSession, tuple[str, int], int], Awaitable[None]]
LATENCIES: list[float] = []  # this run's request latencies, seconds
PREFILL_S_PER_TOKEN = 2e-5  # one device per backend; prefill serialized across its slots
DECODE_S_PER_TOKEN = 0.005  # decoding in parallel across slots


def ideal_hit_rate(workload: Workload) -> float:
    """Infinite cache: each prompt reuses its longest prefix seen in any earlier prompt."""
    seen: set[int] = set()
    cached = total = 0
    order = itertools.zip_longest(*workload.sessions)
    for prompt, _ in (p for round_ in order for p in round_ if p is not None):
        tokens = tokenize(prompt)
        h, best, prefixes = 0, 0, []
        for i, token in enumerate(tokens, 1):
            h = hash((h, token))
            prefixes.append(h)
            if best == i - 1 and h in seen:
                best = i
        seen.update(prefixes)
        cached += min(best, len(tokens) - 1)
        total += len(tokens)
    return cached / total


async def _run_sessions(workload: Workload, send: Send) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def run(index: int, prompts: list[tuple[str, int]]) -> None:
            for position, prompt in enumerate(prompts):
                WHERE.set((index, position))
                await send(session, prompt, index)

        await asyncio.gather(*(run(i, s) for i, s in enumerate(workload.sessions)))


CHAT = False  # --chat
RAM_CACHE = True  # --no-ram-cache: backends run with --cache-ram 0
RAM_TOKENS: int | None = None  # --ram-tokens: what each backend's RAM cache holds
IDLE_SAVES = True  # --no-cache-idle-slots: backends do not save idle slots to the RAM cache
REPLICAS = 1  # --replicas: ours as that many proxies on one Redis, requests round-robin
SHARD = False  # --shard: the replicas split the backends, sessions sticky (a diagnostic)
STREAM = False  # --stream: requests stream their replies (as OpenClaw's do)
ROUTING: dict[str, Any] = {}  # --routing: settings over ours' routing defaults
PROCESS = False  # --process: ours as its own process (bench.outproc), as the peers run
CHECKOUTS: dict[str, str] = {}  # --checkout NAME=DIR: that checkout's proxy runs as ours-NAME
# bench.per_request: called with (session, position), the response body and its headers
OBSERVE: Callable[[tuple[int, int], dict[str, Any], Mapping[str, str]], None] | None = None
WHERE: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("where", default=(-1, -1))


async def _post(
    session: aiohttp.ClientSession, url: str, request: tuple[str, int], key: str | None = None
) -> None:
    """One request; ``key``: the session id, sent to session policies in their headers."""
    prompt, reply = request
    headers = {name: key for name in SESSION_HEADERS} if key is not None else {}
    if CHAT:
        path, body = "/v1/chat/completions", chat_body(prompt, reply)
    else:
        path = "/v1/completions"
        body = {"model": "fake-model", "prompt": prompt, "max_tokens": reply, "temperature": 0}
    if STREAM:
        body["stream"] = True
    sent = time.perf_counter()
    async with session.post(url + path, json=body, headers=headers) as resp:
        if STREAM and resp.status == 200:
            async for line in resp.content:  # as OpenAI SDKs and OpenClaw: up to [DONE] only
                if line.startswith(b"data: [DONE]"):
                    break
        else:
            await resp.read()
        LATENCIES.append(time.perf_counter() - sent)
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {await resp.text()}")
        if OBSERVE is not None and not STREAM:
            OBSERVE(WHERE.get(), await resp.json(), resp.headers)


class _Http2Probes(logging.Filter):
    """Peer routers' HTTP clients open some connections to the fakes with HTTP/2's
    prior-knowledge preface (``PRI * HTTP/2.0``); aiohttp answers 400 and logs a traceback for
    each, and the client goes on over HTTP/1.1. Only those records are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, BadHttpMessage) and "PRI" in str(error))


async def _fleet(backends: int, slots: int, save_dir: Path | None) -> list[FakeLlamaServer]:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _Http2Probes) for f in server_log.filters):
        server_log.addFilter(_Http2Probes())
    fakes = []
    for _ in range(backends):
        fake = FakeLlamaServer(
            n_slots=slots,
            n_ctx=10**7,
            prompt_s_per_token=PREFILL_S_PER_TOKEN,
            gen_s_per_token=DECODE_S_PER_TOKEN,
            save_dir=save_dir,
            ram_cache=RAM_CACHE,
            ram_tokens=RAM_TOKENS,
            cache_idle_slots=IDLE_SAVES,
        )
        await fake.start()
        fakes.append(fake)
    return fakes


def _hit(fakes: list[FakeLlamaServer]) -> tuple[float, int]:
    prompt = sum(f.tokens_prompt - f.tokens_warm for f in fakes)  # clients' prompts only
    computed = sum(f.tokens_processed for f in fakes)
    return 1 - computed / prompt, computed


def _key(session_policy: bool, session: int) -> str | None:
    return f"session-{session}" if session_policy else None


@dataclass(frozen=True)
class Run:
    hit: float  # token-weighted hit rate
    prefill: int  # prompt tokens computed
    seconds: float  # wall time
    latency: float  # mean request latency, seconds


async def run_policy(
    policy: str, workload: Workload, backends: int, slots: int, peers: dict[str, Any]
) -> Run:
    """One policy on a fresh fleet."""
    LATENCIES.clear()
    keyed = ":" in policy  # session policies (and ours:keyed) get each session's id
    save_dir = Path(tempfile.mkdtemp(prefix="replay-slots-"))
    fakes = await _fleet(backends, slots, save_dir if policy.startswith("ours-disk") else None)
    urls = [f.url for f in fakes]
    started = time.perf_counter()
    try:
        if policy == "round-robin":
            turn = itertools.count()
            await _run_sessions(workload, lambda s, p, _: _post(s, urls[next(turn) % len(urls)], p))
        elif policy.startswith("ours"):
            routing: dict[str, Any] = {
                "prefix_aware": policy != "ours-lru",
                "pin_slots": policy != "ours-unpinned",
            }
            routing.update(ROUTING)
            if policy == "ours-patient":
                routing.update(wait_min_tokens=128, max_slot_wait_seconds=30)
            disk = {"prefix_cache": "off"}
            if policy.startswith("ours-disk"):
                disk = {"prefix_cache": "auto", "slot_save_dir": str(save_dir)}
            if policy == "ours-disk-nopark":
                disk["park"] = "off"
            settings = Settings.model_validate(
                {
                    "backends": [
                        {
                            "url": u,
                            "kv_reuse": "prefix",  # the fakes' rule: no start-up probe
                            "ram_cache": RAM_CACHE,
                            "ram_cache_tokens": RAM_TOKENS,
                            "cache_idle_slots": IDLE_SAVES,
                        }
                        for u in urls
                    ],
                    "routing": routing,
                    "disk": disk,
                    "queue": {"max_wait_seconds": 600},
                    "log_level": "WARNING",
                    "replica_url": "off" if policy == "ours-local" else "auto",
                }
            )
            if REPLICAS > 1:
                replicas = (
                    serve_shards(settings, REPLICAS, WHERE)
                    if SHARD
                    else serve_replicas(settings, REPLICAS)
                )
                async with replicas as next_url:
                    await _run_sessions(
                        workload, lambda s, p, i: _post(s, next_url(), p, _key(keyed, i))
                    )
            else:
                if policy.removeprefix("ours-") in CHECKOUTS:
                    ours = serve_process(settings, source=CHECKOUTS[policy.removeprefix("ours-")])
                else:
                    ours = (serve_process if PROCESS else serve)(settings)
                async with ours as url:
                    await _run_sessions(workload, lambda s, p, i: _post(s, url, p, _key(keyed, i)))
        else:
            async with peers[policy](urls) as url:
                started = time.perf_counter()
                await _run_sessions(workload, lambda s, p, i: _post(s, url, p, _key(keyed, i)))
        seconds, latency = time.perf_counter() - started, statistics.fmean(LATENCIES)
        return Run(*_hit(fakes), seconds, latency)
    finally:
        for fake in fakes:
            await fake.stop()
        shutil.rmtree(save_dir, ignore_errors=True)


SMALL_FLEET = (2, 3)  # the issue's own case: 6 agent sessions over 2 backends x 3 slots


def scenarios(
    full: bool, only: list[str] | None = None
) -> list[tuple[Workload, tuple[int, int] | None]]:
    """Workloads, each with its fleet shape (None: the command line's)."""
    few = 8
    base = [
        lmcache("miniswe"),
        lmcache("magagent"),
        lmcache("taubench"),
        mooncake("conversation_trace", 600, 24),
        mooncake("synthetic_trace", 600, 24),
    ]
    out: list[tuple[Workload, tuple[int, int] | None]] = [(w, None) for w in base]
    out += [(Workload(w.name + f" ({few} sessions)", w.sessions[:few]), None) for w in base[:3]]
    six = "6 sessions, {}x{}".format(*SMALL_FLEET)
    out += [(Workload(f"{w.name} ({six})", w.sessions[:6]), SMALL_FLEET) for w in base[:3]]
    if only:
        return [s for s in out if s[0].name in only]
    return out if full else out[:1] + out[5:6]


def _replicas_label() -> str:
    if REPLICAS < 2:
        return ""
    return f", {REPLICAS} replicas" + (" sharded" if SHARD else "")


def _ram_label() -> str:
    if not RAM_CACHE:
        return ", RAM off"
    label = f", RAM {RAM_TOKENS // 1000}k" if RAM_TOKENS else ""
    return label if IDLE_SAVES else label + ", no idle saves"


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    from bench.peers import available_peers

    peers = available_peers()  # --policies may name one; --peers runs them all
    chosen = args.policies or ["round-robin", "ours-lru", "ours"]
    policies = list(dict.fromkeys([*chosen, *(peers if args.peers else [])]))
    rows = []
    for workload, shape in scenarios(not args.quick, args.only):
        backends, slots = shape or (args.backends, args.slots)
        row: dict[str, Any] = {
            "workload": workload.name,
            "fleet": f"{backends}x{slots}" + _ram_label() + _replicas_label(),
            "sessions": len(workload.sessions),
            "requests": sum(len(s) for s in workload.sessions),
            "ideal": ideal_hit_rate(workload),
        }
        if args.repeat > 1:
            row["repeats"] = args.repeat
        for _ in range(args.repeat):  # rounds: every policy once per round, so drift is shared
            for policy in policies:
                run = await run_policy(policy, workload, backends, slots, peers)
                row.setdefault(policy + "_runs", []).append(run.hit)
                row.setdefault(policy + "_prefills", []).append(run.prefill)
                row.setdefault(policy + "_times", []).append(run.seconds)
                row.setdefault(policy + "_latencies", []).append(run.latency)
        for policy in policies:
            row[policy] = statistics.fmean(row[policy + "_runs"])
            row[policy + "_prefill"] = statistics.fmean(row.pop(policy + "_prefills"))
            row[policy + "_seconds"] = statistics.fmean(row.pop(policy + "_times"))
            row[policy + "_latency"] = statistics.fmean(row.pop(policy + "_latencies"))
            if args.repeat == 1:
                del row[policy + "_runs"]
        rows.append(row)
        print(
            json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
            flush=True,
        )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    policies = policy_columns(rows[0])
    print(
        f"\nfleet: fake llama-servers, backends x slots per row ({platform.machine()}); "
        "token-weighted hit rate (prefill tokens computed, wall seconds, mean request "
        "latency); prefill "
        f"{PREFILL_S_PER_TOKEN * 1e6:.0f} us/token serialized per backend, decode "
        f"{DECODE_S_PER_TOKEN * 1e3:.0f} ms/token"
    )
    header = ("workload", "fleet", "sessions", "requests", "ideal", *policies)
    print_markdown(
        header,
        (
            (
                r["workload"],
                r.get("fleet", "-"),  # rows written before the fleet column
                r["sessions"],
                r["requests"],
                f"{r['ideal']:.3f}",
                *(_cell(r, p) for p in policies),
            )
            for r in rows
        ),
    )


def _cell(row: dict[str, Any], policy: str) -> str:
    figures = [f"{row[policy + '_prefill'] / 1000:.0f}k", f"{row[policy + '_seconds']:.0f}s"]
    if policy + "_latency" in row:  # rows written before latency was measured have none
        figures.append(f"{row[policy + '_latency'] * 1000:.0f} ms")
    return f"{row[policy]:.3f} ({', '.join(figures)})"


def main() -> None:
    global PREFILL_S_PER_TOKEN, DECODE_S_PER_TOKEN
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backends", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--peers", action="store_true", help="also run installed peer routers")
    parser.add_argument("--quick", action="store_true", help="two small scenarios")
    parser.add_argument("--from-json", action="store_true", help="re-print the last results")
    parser.add_argument("--only", nargs="*", help="workloads by name, e.g. lmcache/magagent")
    parser.add_argument(
        "--out", help="results name (bench/results/NAME/; default: derived) or a .json path"
    )
    parser.add_argument(
        "--policies", nargs="*", help="run only these (ours-patient, sglang-router, ...)"
    )
    parser.add_argument("--chat", action="store_true", help="send prompts as chat messages")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per policy (fresh fleets); table: means"
    )
    parser.add_argument(
        "--no-ram-cache", action="store_true", help="fakes without the host-RAM prompt cache"
    )
    parser.add_argument(
        "--ram-tokens", type=int, help="bound each fake's RAM cache (and tell the proxy)"
    )
    parser.add_argument(
        "--no-cache-idle-slots",
        action="store_true",
        help="fakes run as llama-server --no-cache-idle-slots (and the proxy is told)",
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="ours as N proxies on one Redis, round-robin"
    )
    parser.add_argument(
        "--shard", action="store_true", help="with --replicas: each its own backends (diagnostic)"
    )
    parser.add_argument("--stream", action="store_true", help="stream replies (as OpenClaw)")
    parser.add_argument(
        "--routing", type=json.loads, default={}, help="routing settings of ours, as JSON"
    )
    parser.add_argument("--process", action="store_true", help="ours as its own process")
    parser.add_argument(
        "--checkout",
        action="append",
        default=[],
        help="NAME=DIR: the proxy of checkout DIR (another commit) runs as policy ours-NAME",
    )
    parser.add_argument(
        "--prefill-us",
        type=float,
        default=PREFILL_S_PER_TOKEN * 1e6,
        help="the fakes' prefill time per token, serialized per backend (e.g. 3000: CPU)",
    )
    parser.add_argument(
        "--decode-ms", type=float, default=DECODE_S_PER_TOKEN * 1e3, help="per generated token"
    )
    args = parser.parse_args()
    global CHAT, RAM_CACHE, RAM_TOKENS, IDLE_SAVES, REPLICAS, SHARD, STREAM, PROCESS
    timing = (args.prefill_us / 1e6, args.decode_ms / 1e3)
    retimed = timing != (PREFILL_S_PER_TOKEN, DECODE_S_PER_TOKEN)
    PREFILL_S_PER_TOKEN, DECODE_S_PER_TOKEN = timing
    CHAT, RAM_CACHE, RAM_TOKENS = args.chat, not args.no_ram_cache, args.ram_tokens
    IDLE_SAVES = not args.no_cache_idle_slots
    REPLICAS, SHARD, STREAM = args.replicas, args.shard, args.stream
    ROUTING.update(args.routing)
    PROCESS = args.process
    CHECKOUTS.update(item.split("=", 1) for item in args.checkout)
    stem = "replay-partial" if (args.only or args.policies or args.quick) else "replay"
    if args.chat:
        stem = "replay-chat" if stem == "replay" else stem + "-chat"
    if args.no_ram_cache:
        stem += "-noram"
    elif args.ram_tokens:
        stem += f"-ram{args.ram_tokens // 1000}k"
    if args.no_cache_idle_slots:
        stem += "-noidle"
    if retimed:
        stem += f"-p{args.prefill_us:g}us-d{args.decode_ms:g}ms"
    if args.replicas > 1:
        stem += f"-replicas{args.replicas}" + ("-shard" if args.shard else "")
    if args.stream:
        stem += "-stream"
    stem = args.out or stem
    if args.from_json:
        path, rows = latest(stem), rows_of(load(stem))
    else:
        rows = asyncio.run(main_async(args))
        path = save(stem, rows)
    print_table(rows)
    plot_replay(rows, path.with_suffix(".png"))


if __name__ == "__main__":
    main()

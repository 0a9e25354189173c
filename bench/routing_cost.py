"""The proxy's own cost per request: fingerprint plus routing decision, by prompt size.

A chat prompt of N tokens (a system prompt and alternating turns) is fingerprinted and
routed against a 4 x 4 fleet whose slots hold other sessions. "seen" means the same
prompt's prefix was fingerprinted before (token counts come from the per-text cache), which
is the steady state of an agent session; "cold" clears that cache first. "RAM model full":
seen, with each backend's model of the RAM prompt cache at its entry limit, every entry a
2k-token session sharing the prompt's system prompt (the worst case: each one is checked);
"of strangers": the same, every entry another system prompt's session (the usual case: one
hash compare per entry).
"raw": the same conversation flattened into one text, as a ``/completion`` prompt (blocks
memoized per 2048-character chunk: "seen" is the earlier turn's text fingerprinted before).

A second table: the decision alone at fleet scale, 64 backends x 8 slots, every slot holding
a ~1,500-token session under one of eight system prompts, for a share of busy slots from none
to all (the decision reads nothing of the requests waiting: their number does not enter it);
each request is, in turn, a returning session's next turn (its slot's system prompt and
conversation) or a new session of one of the eight kinds, and the table gives the median of
all and of each. A third: the same with no slot busy and each backend's RAM-cache model
holding N sessions under the eight system prompts (llama-server's host-RAM cache is on by
default).

A fourth, with ``--fleets``: the second table's decision with no slot busy, by fleet size
(backends x 8 slots), without RAM entries and with 16 per backend.

    python -m bench routing_cost [--fleets 16 64 256]   (results: bench/results/routing_cost/)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.results_io import machine_line, print_markdown, save
from proxy.core.prompt.fingerprint import Fingerprint, fingerprint_chat
from proxy.core.prompt.raw_blocks import fingerprint_text
from proxy.core.routing.decision import RoutingParams, route
from proxy.core.routing.index import FleetIndex
from proxy.core.server.fleet import RAM_ENTRY_LIMIT as LIMIT
from proxy.core.server.fleet import BackendPhase, Fleet, Probe, SlotPhase, SlotProbe
from proxy.core.server.ram_cache import RamEntry
from proxy.routing.tokenizer import TokenCounter

WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy",
    "dog", "while", "agents", "call", "tools", "and", "read", "files",
]  # fmt: skip


def conversation(
    tokens: int, turn_tokens: int = 400, session: str = "", system: str = ""
) -> dict[str, object]:
    messages: list[dict[str, str]] = [{"role": "system", "content": system + " ".join(WORDS * 60)}]
    if session:
        messages.append({"role": "user", "content": session})
    i = 0
    while sum(len(str(m["content"])) for m in messages) / 4 < tokens:
        role = "user" if i % 2 == 0 else "assistant"
        text = f"turn {i} " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(turn_tokens))
        messages.append({"role": role, "content": text})
        i += 1
    return {"messages": messages}


def fleet_with_sessions(counter: TokenCounter, parked: int = 0, strangers: bool = False) -> Fleet:
    fleet = Fleet([f"b{i}" for i in range(4)])
    for index in range(4):
        probe = Probe(BackendPhase.READY, tuple(SlotProbe(i, False, 0, -1) for i in range(4)))
        fleet.apply_probe(index, probe, now=0.0)
        for slot in fleet.backends[index].slots:
            slot.content = fingerprint_chat(conversation(2000 + 100 * slot.id), counter.count)
        fleet.backends[index].ram_entries = [
            RamEntry(fingerprint_chat(entry(f"{index}/{k}", strangers), counter.count), 0)
            for k in range(parked)
        ]
    return fleet


def entry(name: str, stranger: bool) -> dict[str, object]:
    """A parked 2k-token session: another system prompt's when ``stranger``."""
    if stranger:
        return conversation(2000, system=f"agent {name}: ")
    return conversation(2000, session=name)


def measure(
    tokens: int,
    seen: bool,
    repeats: int = 30,
    parked: int = 0,
    raw: bool = False,
    strangers: bool = False,
) -> float:
    counter = TokenCounter()
    fleet = fleet_with_sessions(counter, parked, strangers)
    body = conversation(tokens)
    texts = [str(m["content"]) for m in body["messages"]]  # type: ignore[attr-defined]
    params = RoutingParams()
    samples = []
    index = FleetIndex()  # kept across decisions, as the router keeps it

    def fingerprint(turns: int) -> Fingerprint:
        if raw:
            text = "\n\n".join(texts[:turns])
            return fingerprint_text(text, lambda at, part: counter.blocks(at, part, 16))
        return fingerprint_chat({"messages": body["messages"][:turns]}, counter.count)  # type: ignore[index]

    for _ in range(repeats):
        if not seen:
            counter = TokenCounter()
        else:
            fingerprint(len(texts) - 1)  # the earlier turn
        started = time.perf_counter()
        fp = fingerprint(len(texts))
        route(fp, fleet.backends, params, now=1.0, index=index)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


def at_scale(
    busy_share: float, backends: int = 64, slots: int = 8, parked: int = 0
) -> tuple[float, float, float]:
    """Median ms of one routing decision over a ``backends`` x ``slots`` fleet (tables 2 and
    3): of every request, of the returning sessions' and of the new sessions'. ``parked``:
    sessions each backend's RAM-cache model holds, under the same system prompts."""
    rng, counter = random.Random(1), TokenCounter()
    kinds = [f"agent kind {k}: " for k in range(8)]
    kind_of: dict[str, str] = {}
    fleet = Fleet([f"b{i}" for i in range(backends)])
    for index in range(backends):
        probe = Probe(BackendPhase.READY, tuple(SlotProbe(i, False, 0, -1) for i in range(slots)))
        fleet.apply_probe(index, probe, now=0.0)
        for slot in fleet.backends[index].slots:
            session = f"s{index}/{slot.id}"
            kind_of[session] = rng.choice(kinds)
            body = conversation(1500, session=session, system=kind_of[session])
            slot.content = fingerprint_chat(body, counter.count)
            slot.last_used = rng.random() * 100
            if rng.random() < busy_share:
                slot.phase, slot.pending = SlotPhase.BUSY, slot.content
        fleet.backends[index].ram_entries = [
            RamEntry(
                fingerprint_chat(
                    conversation(1500, session=f"p{index}/{k}", system=rng.choice(kinds)),
                    counter.count,
                ),
                rng.random() * 100,
            )
            for k in range(parked)
        ]
    samples: dict[bool, list[float]] = {True: [], False: []}
    kept = FleetIndex()  # kept across decisions, as the router keeps it
    for i in range(200):
        returning = bool(i % 2)
        session = f"s{rng.randrange(backends)}/{rng.randrange(slots)}" if returning else f"new{i}"
        body = conversation(1500, session=session, system=kind_of.get(session, rng.choice(kinds)))
        body["messages"].append({"role": "user", "content": f"turn {i}"})  # type: ignore[attr-defined]
        fp = fingerprint_chat(body, counter.count)
        started = time.perf_counter()
        route(
            fp,
            fleet.backends,
            RoutingParams(),
            now=200.0,
            index=kept,
        )
        samples[returning].append(time.perf_counter() - started)
    every = samples[True] + samples[False]
    return tuple(  # type: ignore[return-value]
        statistics.median(xs) * 1000 for xs in (every, samples[True], samples[False])
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleets", type=int, nargs="*", default=[], help="backends per fleet")
    args = parser.parse_args()
    print(f"{machine_line()}; median of 30, fingerprint + routing decision over a 4 x 4 fleet")
    prompts = [
        {
            "tokens": tokens,
            "seen_ms": measure(tokens, True),
            "cold_ms": measure(tokens, False, repeats=5),
            "ram_full_ms": measure(tokens, True, parked=LIMIT),
            "ram_strangers_ms": measure(tokens, True, parked=LIMIT, strangers=True),
            "raw_seen_ms": measure(tokens, True, raw=True),
            "raw_cold_ms": measure(tokens, False, repeats=5, raw=True),
        }
        for tokens in (8_000, 32_000, 128_000)
    ]
    print_markdown(
        [
            "prompt tokens",
            "prefix seen (ms)",
            "cold (ms)",
            f"RAM model full ({LIMIT}) (ms)",
            "of strangers (ms)",
            "raw, prefix seen (ms)",
            "raw, cold (ms)",
        ],
        [[f"{r['tokens'] // 1000}k", *(f"{v:.2f}" for k, v in r.items() if k != "tokens")]
         for r in prompts],
    )  # fmt: skip
    print()
    print("routing decision alone, 64 backends x 8 slots (median of 200)")
    scale = []
    for share in (0.0, 0.5, 0.9, 1.0):
        every, returning, new = at_scale(share)
        scale.append({"busy": share, "p50_ms": every, "returning_ms": returning, "new_ms": new})
    print_markdown(
        ["busy slots", "decision p50 (ms)", "returning sessions (ms)", "new sessions (ms)"],
        [[f"{r['busy']:.0%}", *(f"{v:.3f}" for v in list(r.values())[1:])] for r in scale],
    )
    print()
    print("the same, no slot busy, each backend's RAM-cache model holding N sessions")
    ram = []
    for parked in (16, 64):
        every, returning, new = at_scale(0.0, parked=parked)
        ram.append({"parked": parked, "p50_ms": every, "returning_ms": returning, "new_ms": new})
    print_markdown(
        ["RAM entries (N)", "decision p50 (ms)", "returning sessions (ms)", "new sessions (ms)"],
        [[str(r["parked"]), *(f"{v:.3f}" for v in list(r.values())[1:])] for r in ram],
    )
    fleets: list[dict[str, object]] = []
    rows = []
    for backends in args.fleets:
        bare = at_scale(0.0, backends=backends)
        held = at_scale(0.0, backends=backends, parked=16)
        fleets.append({"backends": backends, "no_ram_ms": bare, "ram_16_ms": held})
        rows.append([str(backends), *(" / ".join(f"{v:.2f}" for v in t) for t in (bare, held))])
    if rows:
        print()
        print("by fleet size, no slot busy: median ms of all / returning / new sessions")
        print_markdown(["backends", "no RAM entries", "16 RAM entries per backend"], rows)
    save("routing_cost", {"prompts": prompts, "at_scale": scale, "with_ram": ram, "fleets": fleets})


if __name__ == "__main__":
    main()

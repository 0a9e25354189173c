"""The disk scope's window trade-off on real traces.

For each trace and policy, requests are replayed in arrival order through the proxy's own
scope selection (``proxy.core.disk.scope.select_prefix``, the code the proxy runs) against
a simulated disk that keeps every snapshot. Per request: the longest snapshot that is a
prefix of it is what a restore would serve; then the policy's selected prefix is saved if
it is not on disk yet. Reported per policy:

- tokens/snapshot: mean size of the selected prefixes (what a save writes);
- key hits: requests whose selected prefix was already on disk;
- disk hits: requests with any snapshot of at least ``min_tokens`` that is a prefix of it;
- served: share of all prompt tokens a restore would serve;
- snapshots: files written (disk use).

Boundaries: LMCache agent traces are split into paragraphs (blank lines; the agents' role
turns start paragraphs), counted with tiktoken; Mooncake requests are chains of 512-token
blocks. ``full`` saves the whole prompt each time; ``N`` is a fixed token count.

    python -m bench.disk_window
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable
from typing import Any

import xxhash

from bench.results_io import print_markdown, save
from bench.workloads import TRACES
from proxy.core.disk.scope import ScopeMode, parse_scope, select_prefix
from proxy.core.prompt.fingerprint import Fingerprint
from proxy.routing.tokenizer import TokenCounter

POLICIES = ["auto:2", "auto:8", "auto:30", "4096", "full"]
_PARAGRAPH = re.compile(r"\n\s*\n")


def _chain(keys: Iterable[bytes], sizes: Iterable[int]) -> Fingerprint:
    hashes, tokens, h, total = [], [], 0, 0
    for key, size in zip(keys, sizes, strict=True):
        h = xxhash.xxh3_64_intdigest(key, seed=h)
        total += size
        hashes.append(h)
        tokens.append(total)
    return Fingerprint(tuple(hashes), tuple(tokens))


def lmcache_requests(kind: str, counter: TokenCounter) -> list[Fingerprint]:
    calls = []
    for path in sorted((TRACES / "lmcache_agent_trace" / kind).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                call = json.loads(line)
                if call.get("input"):
                    calls.append((call["timestamp"], call["input"]))
    calls.sort()
    out = []
    for _, text in calls:
        parts = _PARAGRAPH.split(text)
        out.append(_chain((p.encode() for p in parts), (counter.count(p) + 2 for p in parts)))
    return out


def mooncake_requests(name: str, limit: int = 2000) -> list[Fingerprint]:
    lines = (TRACES / "mooncake_fast25" / f"{name}.jsonl").read_text().splitlines()[:limit]
    out = []
    for line in lines:
        ids = json.loads(line)["hash_ids"]
        out.append(_chain((i.to_bytes(8, "little") for i in ids), (512 for _ in ids)))
    return out


def simulate(requests: list[Fingerprint], policy: str, min_tokens: int) -> dict[str, Any]:
    scope = parse_scope(policy)
    disk: dict[int, int] = {}  # chain hash at the snapshot's end -> its tokens
    window: list[Fingerprint] = []
    sizes, key_hits, disk_hits, served, total = [], 0, 0, 0, 0
    for fp in requests:
        total += fp.total
        best = max((disk[h] for h in fp.hashes if h in disk), default=0)
        if best >= min_tokens:
            disk_hits += 1
            served += min(best, fp.total - 1)
        if scope.mode is ScopeMode.FULL:
            segments, tokens = len(fp.hashes), fp.total
        else:
            choice = select_prefix(scope, fp, window, min_tokens)
            segments, tokens = choice.segments, choice.tokens
        if segments and tokens >= min_tokens:
            sizes.append(tokens)
            key = fp.hashes[segments - 1]
            key_hits += key in disk
            disk.setdefault(key, tokens)
        window.insert(0, fp)
        del window[64:]
    n = len(requests)
    return {
        "tokens_per_snapshot": sum(sizes) / len(sizes) if sizes else 0,
        "key_hits": key_hits / n,
        "disk_hits": disk_hits / n,
        "served": served / total if total else 0,
        "snapshots": len(disk),
        "requests": n,
    }


def run(min_tokens: int) -> list[dict[str, Any]]:
    counter = TokenCounter()
    traces = {
        f"lmcache/{kind}": lmcache_requests(kind, counter)
        for kind in ("miniswe", "magagent", "taubench")
    }
    traces["mooncake/conversation"] = mooncake_requests("conversation_trace")
    traces["mooncake/synthetic"] = mooncake_requests("synthetic_trace")
    rows = []
    for name, requests in traces.items():
        for policy in POLICIES:
            rows.append({"trace": name, "policy": policy, **simulate(requests, policy, min_tokens)})
    return rows


def print_table(rows: list[dict[str, Any]], min_tokens: int) -> None:
    print(f"\ndisk scope trade-off (min snapshot {min_tokens} tokens; every snapshot kept)")
    header = ("trace", "policy", "tokens/snapshot", "key hits", "disk hits", "served", "snapshots")
    print_markdown(
        header,
        (
            (
                r["trace"],
                r["policy"],
                f"{r['tokens_per_snapshot']:.0f}",
                f"{r['key_hits']:.0%}",
                f"{r['disk_hits']:.0%}",
                f"{r['served']:.0%}",
                r["snapshots"],
            )
            for r in rows
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--min-tokens", type=int, default=256)
    args = parser.parse_args()
    rows = run(args.min_tokens)
    path = save("disk_window", rows)
    print_table(rows, args.min_tokens)
    from bench.plots import plot_disk_window

    plot_disk_window(rows, path.with_suffix(".png"))


if __name__ == "__main__":
    main()

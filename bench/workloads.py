"""Replay workloads built from the traces in ``bench/data`` (each directory's SOURCE.md: origin,
commit, licence, format).

- LMCache agent traces: one session per file, one call per line; ``input`` is sent as a raw
  completion prompt (it is a flattening of the conversation, not chat messages).
- Mooncake FAST'25: requests with prefix-chained 512-token block ids; each block becomes
  ``words_per_block`` distinct words (scaled down: hit rates are ratios), replayed in order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TRACES = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: list[list[tuple[str, int]]]  # per session: (prompt, reply tokens), in order


def lmcache(kind: str, limit_sessions: int | None = None, max_chars: int = 60_000) -> Workload:
    sessions = []
    for path in sorted((TRACES / "lmcache_agent_trace" / kind).glob("*.jsonl")):
        calls = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        calls.sort(key=lambda c: c["timestamp"])
        prompts = [
            (c["input"][:max_chars], max(1, min(64, len(c.get("output") or "") // 4)))
            for c in calls
            if c.get("input")
        ]
        if prompts:
            sessions.append(prompts)
    return Workload(f"lmcache/{kind}", sessions[:limit_sessions])


def mooncake(
    name: str = "conversation_trace",
    requests: int = 600,
    streams: int = 16,
    words_per_block: int = 16,
) -> Workload:
    """Requests in trace order, dealt round-robin onto ``streams`` sequential streams."""
    lines = (TRACES / "mooncake_fast25" / f"{name}.jsonl").read_text().splitlines()[:requests]
    streams_out: list[list[tuple[str, int]]] = [[] for _ in range(streams)]
    for i, line in enumerate(lines):
        request = json.loads(line)
        ids = request["hash_ids"]
        text = " ".join(f"m{b}w{j}" for b in ids for j in range(words_per_block))
        reply = max(1, min(64, request["output_length"] // 32))
        streams_out[i % streams].append((text, reply))
    return Workload(f"mooncake/{name}", [s for s in streams_out if s])


def chat_body(prompt: str, reply: int) -> dict[str, object]:
    """A flattened prompt as chat messages: paragraphs (blank-line separated; agents start
    each turn with one) become messages, the first one the system prompt, so message
    boundaries are where sessions share and diverge."""
    parts = [p for p in prompt.split("\n\n") if p.strip()] or [prompt]
    messages = [{"role": "system", "content": parts[0]}]
    messages += [{"role": "user", "content": p} for p in parts[1:]]
    return {"model": "fake-model", "messages": messages, "max_tokens": reply, "temperature": 0}

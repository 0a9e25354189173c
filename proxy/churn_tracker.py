"""Per-session prefix-churn records (algorithm: ``core.churn``), for the admin endpoint,
metrics and ``llama-cache-proxy report``. Bounded: the sketches of the most recent
``sessions`` sessions (LRU) and the last ``recent`` divergences."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import xxhash

from proxy.core.churn import Divergence, Sketch, divergence, message_bucket, sketch
from proxy.core.fingerprint import Fingerprint, Segment, canonical
from proxy.metrics import ProxyMetrics


class ChurnTracker:
    def __init__(
        self,
        metrics: ProxyMetrics,
        wall: Callable[[], float],
        *,
        sessions: int = 2000,
        recent: int = 200,
    ) -> None:
        self._metrics = metrics
        self._wall = wall
        self._sketches: OrderedDict[str, Sketch] = OrderedDict()
        self._limit = sessions
        self.recent: deque[Divergence] = deque(maxlen=recent)
        self._lost: Counter[str] = Counter()
        self._count: Counter[str] = Counter()

    @staticmethod
    def session_of(key: str | None, body: dict[str, Any]) -> str | None:
        """The cache_key, else the first user message's own text (not the chain hash, which
        also covers the system prompt: the part that churns)."""
        if key is not None:
            return f"key:{key}"
        messages = body.get("messages")
        for message in messages if isinstance(messages, list) else []:
            if isinstance(message, dict) and message.get("role") == "user":
                digest = xxhash.xxh3_64_hexdigest(canonical(message.get("content")))
                return f"first-user-message:{digest}"
        return None

    def observe(
        self, key: str | None, fp: Fingerprint, body: dict[str, Any], segments: Sequence[Segment]
    ) -> None:
        """Compare this request (``segments``: its chat segments, ``fp`` their chain) with the
        session's previous one."""
        session = self.session_of(key, body)
        if session is None:
            return
        new = sketch(fp, segments)
        old = self._sketches.pop(session, None)
        self._sketches[session] = new
        if len(self._sketches) > self._limit:
            self._sketches.popitem(last=False)
        if old is None:
            return
        found = divergence(session, old, new, self._wall())
        if found is None:
            return
        self.recent.append(found)
        self._lost[session] += found.tokens_lost
        self._count[session] += 1
        self._metrics.divergences.labels(message_bucket(found.message_index)).inc()
        self._metrics.tokens_lost.inc(found.tokens_lost)

    def status(self) -> dict[str, Any]:
        where = Counter(message_bucket(d.message_index) + " " + d.role for d in self.recent)
        return {
            "sessions_tracked": len(self._sketches),
            "top_sessions": [
                {"session": s, "tokens_lost": lost, "divergences": self._count[s]}
                for s, lost in self._lost.most_common(20)
            ],
            "where": dict(where.most_common()),
            "recent": [asdict(d) for d in list(self.recent)[-50:]],
        }

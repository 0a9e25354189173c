"""Per-session prefix-churn records (algorithm: ``core.routing.churn``), for the admin endpoint,
metrics and ``llama-cache-proxy report``. Bounded: the sketches of the most recent
``sessions`` sessions (LRU) within ``SKETCH_BYTES`` accounted bytes (a sketch of a prompt
of many messages is large), the last ``recent`` divergences, and the tokens lost of at most
twice ``sessions`` sessions (then those that lost the most ``sessions``)."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import xxhash

from proxy.core.prompt.fingerprint import Fingerprint, Segment, canonical
from proxy.core.routing.churn import Divergence, Sketch, divergence, message_bucket, sketch
from proxy.metrics import ProxyMetrics

SKETCH_BYTES = 16 * 1024 * 1024  # the sketches' budget, accounted by ``_size``
SEGMENT_BYTES = 120  # a sketched segment beside its excerpt: hash, count, role, tuple slots


def _size(found: Sketch) -> int:
    """Bytes a sketch holds, at most (text that is not ASCII takes up to 4 a character)."""
    return sum(len(text) * (1 if text.isascii() else 4) + SEGMENT_BYTES for text in found.texts)


class ChurnTracker:
    def __init__(
        self,
        metrics: ProxyMetrics,
        wall: Callable[[], float],
        *,
        sessions: int = 2000,
        recent: int = 200,
        budget: int = SKETCH_BYTES,
    ) -> None:
        self._metrics = metrics
        self._wall = wall
        self._sketches: OrderedDict[str, Sketch] = OrderedDict()
        self._limit = sessions
        self._budget = budget
        self.accounted = 0  # bytes of the sketches kept
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
        self.accounted += _size(new) - (0 if old is None else _size(old))
        while len(self._sketches) > self._limit or self.accounted > self._budget:
            self.accounted -= _size(self._sketches.popitem(last=False)[1])
        if old is None:
            return
        found = divergence(session, old, new, self._wall())
        if found is None:
            return
        self.recent.append(found)
        self._lost[session] += found.tokens_lost
        self._count[session] += 1
        if len(self._lost) > 2 * self._limit:  # the sessions that lost the most, ``sessions``
            kept = dict(self._lost.most_common(self._limit))
            self._lost = Counter(kept)
            self._count = Counter({s: self._count[s] for s in kept})
        self._metrics.divergences.labels(message_bucket(found.message_index)).inc()
        self._metrics.tokens_lost.inc(found.tokens_lost)

    def status(self, text: bool = False) -> dict[str, Any]:
        """``text``: show session keys and prompt excerpts (users' keys and prompts); by
        default a key is shown as its hash and excerpts as ``REDACTED``."""
        where = Counter(message_bucket(d.message_index) + " " + d.role for d in self.recent)
        name = str if text else _redacted_session
        recent = [asdict(d) for d in list(self.recent)[-50:]]
        if not text:
            for d in recent:
                d.update(session=name(d["session"]), before=REDACTED, after=REDACTED)
        return {
            "sessions_tracked": len(self._sketches),
            "top_sessions": [
                {"session": name(s), "tokens_lost": lost, "divergences": self._count[s]}
                for s, lost in self._lost.most_common(20)
            ],
            "where": dict(where.most_common()),
            "recent": recent,
        }


REDACTED = "[redacted: admin_churn_text shows it]"


def _redacted_session(session: str) -> str:
    """A cache_key session as the key's hash (first-user-message sessions are hashes)."""
    if not session.startswith("key:"):
        return session
    return "key-hash:" + xxhash.xxh3_64_hexdigest(session.encode("utf-8", "surrogateescape"))

"""Every metric name and label in one place, on a registry the composition root owns.

Hit rate (token-weighted) = rate(cached_tokens_total) / rate(prompt_tokens_total), from each
backend response's ``timings`` (``cache_n`` and ``prompt_n + cache_n``), less the tokens a
disk-tier warm-up computed for the request (they reached the KV by a prefill, not from a cache;
its prefill seconds count too). Labels are bounded:
endpoint (the fixed route table), status, backend label, cache outcome, error kind, slot
phase, decision reason, prediction outcome, cache_key outcome, state-store operation, disk
event and refusal reason.

Disk tier: ``disk_events_total{event}`` counts hits (a restore that the next request reused),
misses (a request the disk tier was asked to serve, with no snapshot of any prefix of it),
saves (scoped, full and park), restores, shared (a scoped save skipped for a restore of
the same prefix another request was saving), bad (restores not reused, snapshot marked bad),
refusals (layout mismatch, or a failed restore), evictions (budget), strays (files the
index does not list, deleted for the budget) and capped (a save skipped: the client is over
its write cap, ``disk.client_max_bytes``); the index size and
bytes are gauges, and ``disk_policy_info{policy}`` names the default scope.

Every series exists from the start (``zero``): each label value the code knows (``KNOWN``,
per backend, per proxied endpoint) is set to 0, so a dashboard shows 0, not "No data", and
``increase()`` sees the first event.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

import prometheus_client
from prometheus_client import CollectorRegistry

from proxy.core.prompt.usage import Usage
from proxy.core.routing.decision import KeyOutcome, Reason
from proxy.core.server.slots import SlotPhase
from proxy.upstream import ROUTES, SlotUse

PREFIX = "llama_cache_proxy_"
_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


# Every label value the code passes to ``.labels("...")`` (a unit test keeps this in step).
KNOWN: dict[str, tuple[str, ...]] = {
    "rejected": ("no_backend", "queue_full", "wait_timeout", "shutting_down"),
    "route_decisions": tuple(r.value for r in Reason),
    "cache_key": tuple(KeyOutcome),
    "route_predictions": ("accurate", "over", "under"),
    "forwards": ("sent", "unreachable", "received", "rejected"),
    "disk_events": (
        *("hit", "miss", "save", "restore", "shared", "bad", "refusal", "eviction"),
        *("stray", "capped"),
    ),
    "disk_saves": ("scoped", "full", "park"),
    "disk_refusals": ("layout", "failed"),
    "ram_primers": ("sent", "failed"),
    "divergences": ("preamble", *(str(i) for i in range(10)), "10+"),
    "store_errors": (
        *("view", "window", "push_window", "get_affinity", "set_affinity", "claimed"),
        *("put_slot", "clear_slots", "put_release", "claim_release", "heartbeat", "leave"),
        *("acquire_lease", "renew_lease", "release_lease"),
        *("get_snapshots", "all_snapshots", "update_snapshots"),
    ),
}
UPSTREAM_ERRORS = ("connect", "loading", "timeout", "failed")
TTFT_CACHE = ("hit", "miss", "unknown")


class _Known:
    """``labels`` from a dict once a label set has been asked for: prometheus_client checks
    the values and takes a lock at every call, and a request asks for about ten children.
    Label sets are bounded (the module docstring); a removed child is forgotten too (asked
    for again, it is exported again)."""

    _known: dict[tuple[Any, ...], Self]

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Self:
        try:
            return self._known[labelvalues]
        except AttributeError:
            self._known = {}
        except KeyError:
            pass
        child: Self = super().labels(*labelvalues, **labelkwargs)  # type: ignore[misc]
        if not labelkwargs:
            self._known[labelvalues] = child
        return child

    def remove(self, *labelvalues: Any) -> None:
        super().remove(*labelvalues)  # type: ignore[misc]
        getattr(self, "_known", {}).pop(labelvalues, None)


class Counter(_Known, prometheus_client.Counter):
    pass


class Gauge(_Known, prometheus_client.Gauge):
    pass


class Histogram(_Known, prometheus_client.Histogram):
    pass


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, labels: Sequence[str] = ("endpoint",)) -> Histogram:
            return Histogram(
                PREFIX + name, doc, labels, buckets=_LATENCY_BUCKETS, registry=registry
            )

        self.requests = counter(
            "requests", "Client requests by endpoint and status", ["endpoint", "status"]
        )
        self.duration = histogram("request_duration_seconds", "Time from request to last byte")
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Time from request to first streamed body byte, by cache outcome: hit (at least "
            "half the prompt served from KV), miss, unknown (no usage reported)",
            ("endpoint", "cache"),
        )
        self.slot_wait = histogram(
            "slot_wait_seconds",
            "Time from asking for a slot to holding one: the routing decision, and the wait "
            "when every slot is busy or the router waits for the one holding the prefix",
        )
        self.upstream_errors = counter(
            "upstream_errors", "Backend failures by kind", ["backend", "kind"]
        )
        self.upstream_connections = counter(
            "upstream_connections",
            "Connections opened to each backend (kept alive and reused: near the request rate, "
            "something between closes them)",
            ["backend"],
        )
        self.in_flight = gauge("requests_in_flight", "Requests being served")
        self.queued = gauge("requests_queued", "Requests waiting for a slot")
        self.slot_hold = gauge(
            "slot_hold_seconds", "How long a slot a session left is held for its next turn"
        )
        self.slot_hold_waits = counter(
            "slot_hold_waits", "Requests that waited because every idle slot was held"
        )
        self.rejected = counter(
            "queue_rejections", "Requests answered 503 by the queue", ["reason"]
        )
        self.backend_ready = gauge("backend_ready", "1 when the backend is ready", ["backend"])
        self.backend_restarts = counter(
            "backend_restarts", "Times a backend's slot state was invalidated", ["backend"]
        )
        self.slots = gauge("slots", "Slots by phase", ["backend", "phase"])
        self.route_decisions = counter("route_decisions", "Routing decisions by reason", ["reason"])
        self.cache_key = counter(
            "cache_key", "Keyed requests by outcome: reuse, unsafe, busy, outmatched", ["outcome"]
        )
        self.predicted_tokens = counter(
            "predicted_cached_tokens",
            "Prompt tokens the router expected to be cached",
            ["backend"],
        )
        self.route_predictions = counter(
            "route_predictions",
            "Routed requests by prediction outcome: accurate (actual within 10%), over, under",
            ["outcome"],
        )
        self.store_errors = counter(
            "state_store_errors", "State-store operations that failed", ["op"]
        )
        self.store_up = gauge("state_store_up", "1 when the state store answers")
        self.store_conflicts = counter(
            "state_store_conflicts",
            "Slots this replica held, pinned while the store was down or after it lost their "
            "leases, that another replica also held",
        )
        self.forwards = counter(
            "forwarded_requests",
            "Requests sent to the replica that schedules their backend (sent), that could not"
            " reach it and were routed here (unreachable), received from another (received), and"
            " carrying a forwarding mark that did not verify, served as a client's (rejected)",
            ["outcome"],
        )
        self.replicas_live = gauge(
            "replicas_live",
            "Live replicas (this one included) in the last heartbeat read that have read this"
            " one's heartbeat too (until they have, an outage leaves it no slot of its own)",
        )
        self.replicas_rejected = gauge(
            "replica_entries_rejected",
            "Entries of the store's replica list that did not verify with replicas.secret in"
            " the last heartbeat read: ignored (written without the secret, or replayed)",
        )
        self.replicas_fenced = gauge(
            "replicas_fenced",
            "Replicas whose heartbeat lapsed without leaving (cut off from the store, or dead)"
            " for a heartbeat TTL or more: their part of the fleet is kept off",
        )
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of completed requests", ["backend"]
        )
        self.cached_tokens = counter(
            "cached_tokens",
            "Prompt tokens served from a slot's KV cache (not the ones a disk-tier warm-up"
            " computed for the request)",
            ["backend"],
        )
        self.prefill_seconds = counter(
            "prefill_seconds",
            "Seconds backends spent on prompt tokens they computed (timings.prompt_ms)",
            ["backend"],
        )
        self.ram_primers = counter(
            "ram_primers",
            "Primers sent to a slot so that the server loads the request's session from its RAM"
            " prompt cache (sent), and those the server failed (failed: the request went on)",
            ["outcome"],
        )
        self.disk_events = counter(
            "disk_events",
            "Disk tier events: hit, miss, save, restore, shared, bad, refusal, eviction, "
            "stray (an unindexed file deleted), capped (a save over the client's write cap)",
            ["event"],
        )
        self.disk_saves = counter("disk_saves", "Snapshots written, by kind", ["kind"])
        self.disk_refusals = counter(
            "disk_refusals", "Restores refused or failed, by reason", ["reason"]
        )
        self.disk_entries = gauge("disk_index_entries", "Snapshots in the index")
        self.disk_bytes = gauge("disk_bytes", "Bytes of indexed snapshots")
        self.disk_restored_tokens = counter(
            "disk_restored_tokens", "Tokens loaded into slots from disk snapshots"
        )
        self.disk_policy = gauge("disk_policy_info", "The default disk scope", ["policy"])
        self.divergences = counter(
            "prefix_divergences",
            "Prompts that stopped extending their session's previous prompt, by the message "
            "index where they first differ (preamble = tools / template kwargs)",
            ["message"],
        )
        self.tokens_lost = counter(
            "prefix_tokens_lost", "Estimated tokens of previous prompts lost to prefix churn"
        )
        self.backend_model = gauge(
            "backend_model_info",
            "1 for the model each backend serves (from /props); join on backend for per-model "
            "panels",
            ["backend", "model"],
        )

    def zero(self, backends: Sequence[str]) -> None:
        """Every known series at 0 (``KNOWN``; per backend label; per proxied endpoint)."""
        for name, values in KNOWN.items():
            for value in values:
                getattr(self, name).labels(value)
        per_backend: tuple[Gauge | Counter, ...] = (self.backend_ready, self.backend_restarts)
        per_backend += (self.predicted_tokens, self.prompt_tokens, self.cached_tokens)
        per_backend += (self.prefill_seconds,)
        for backend in backends:
            for metric in per_backend:
                metric.labels(backend)
            for kind in UPSTREAM_ERRORS:
                self.upstream_errors.labels(backend, kind)
            self.upstream_connections.labels(backend)
            for phase in SlotPhase:
                self.slots.labels(backend, phase.value)
        for path, route in ROUTES.items():
            self.requests.labels(path, "200")
            self.duration.labels(path)
            if route.slot_use is not SlotUse.NONE:  # (requests that generate)
                self.slot_wait.labels(path)
                for cache in TTFT_CACHE:
                    self.ttft.labels(path, cache)

    def response(
        self, path: str, label: str, ttft: float | None, usage: Usage | None, warmed: int = 0
    ) -> None:
        """A backend response's time to first byte and usage (cache hit: half the prompt);
        ``warmed``: of its cached tokens, those a disk-tier warm-up computed for it."""
        cached = 0 if usage is None else max(0, usage.cached_tokens - warmed)
        if ttft is not None:
            cache = "unknown"
            if usage is not None and usage.prompt_tokens > 0:
                cache = "hit" if cached * 2 >= usage.prompt_tokens else "miss"
            self.ttft.labels(path, cache).observe(ttft)
        if usage is None:
            return
        if usage.prompt_ms is not None:
            self.prefill_seconds.labels(label).inc(usage.prompt_ms / 1000)
        self.prompt_tokens.labels(label).inc(usage.prompt_tokens)
        self.cached_tokens.labels(label).inc(cached)

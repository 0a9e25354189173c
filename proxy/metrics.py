"""Every metric name and label in one place, on a registry the composition root owns.

Hit rate (token-weighted) = rate(cached_tokens_total) / rate(prompt_tokens_total), from each
backend response's ``timings`` (``cache_n`` and ``prompt_n + cache_n``). Labels are bounded:
endpoint (the fixed route table), status, backend label, error kind, slot phase.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        p = "llama_cache_proxy_"
        self.requests = Counter(
            p + "requests",
            "Client requests by endpoint and status",
            ["endpoint", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            p + "request_duration_seconds",
            "Time from request to last byte",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Time from request to first streamed body byte",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.upstream_errors = Counter(
            p + "upstream_errors",
            "Backend failures by kind",
            ["backend", "kind"],
            registry=registry,
        )
        self.in_flight = Gauge(p + "requests_in_flight", "Requests being served", registry=registry)
        self.queued = Gauge(p + "requests_queued", "Requests waiting for a slot", registry=registry)
        self.rejected = Counter(
            p + "queue_rejections",
            "Requests answered 503 by the queue",
            ["reason"],
            registry=registry,
        )
        self.backend_ready = Gauge(
            p + "backend_ready", "1 when the backend is ready", ["backend"], registry=registry
        )
        self.backend_restarts = Counter(
            p + "backend_restarts",
            "Times a backend's slot state was invalidated",
            ["backend"],
            registry=registry,
        )
        self.slots = Gauge(p + "slots", "Slots by phase", ["backend", "phase"], registry=registry)
        self.route_decisions = Counter(
            p + "route_decisions", "Routing decisions by reason", ["reason"], registry=registry
        )
        self.cache_key = Counter(
            p + "cache_key",
            "Keyed requests by outcome: reuse, unsafe, busy",
            ["outcome"],
            registry=registry,
        )
        self.predicted_tokens = Counter(
            p + "predicted_cached_tokens",
            "Prompt tokens the router expected to be cached",
            ["backend"],
            registry=registry,
        )
        self.route_predictions = Counter(
            p + "route_predictions",
            "Routed requests by prediction outcome: accurate (actual within 10%), over, under",
            ["outcome"],
            registry=registry,
        )
        self.store_errors = Counter(
            p + "state_store_errors",
            "State-store operations that failed",
            ["op"],
            registry=registry,
        )
        self.store_up = Gauge(
            p + "state_store_up", "1 when the state store answers", registry=registry
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens",
            "Prompt tokens of completed requests",
            ["backend"],
            registry=registry,
        )
        self.cached_tokens = Counter(
            p + "cached_tokens",
            "Prompt tokens served from a slot's KV cache",
            ["backend"],
            registry=registry,
        )

"""``metrics.KNOWN`` lists every label value the code emits, so ``zero`` creates each series
before its first event; and ``zero`` does create them."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from proxy.metrics import KNOWN, ProxyMetrics

SOURCE = "\n".join(p.read_text() for p in (Path(__file__).parents[2] / "proxy").rglob("*.py"))


def _literals(pattern: str) -> set[str]:
    return set(re.findall(pattern, SOURCE))


def test_every_literal_label_value_is_known() -> None:
    for name, known in KNOWN.items():
        used = _literals(rf'\.{name}\.labels\(\s*"([^"]+)"\s*\)')
        assert used <= set(known), (name, used - set(known))


def test_every_state_store_operation_and_queue_rejection_is_known() -> None:
    ops = _literals(r'\.call\(\s*"([a-z_]+)"')
    assert ops
    assert ops <= set(KNOWN["store_errors"]), ops - set(KNOWN["store_errors"])
    reasons = _literals(r'_unavailable\([^()]*?,\s*"([a-z_]+)"\)')
    assert reasons == set(KNOWN["rejected"])


def test_zero_creates_every_known_series_at_zero() -> None:
    metrics = ProxyMetrics(CollectorRegistry())
    metrics.zero(["gpu0", "gpu1"])
    page = generate_latest(metrics.registry).decode()
    for name, wanted in [
        ('llama_cache_proxy_queue_rejections_total{reason="queue_full"}', 0.0),
        ('llama_cache_proxy_cache_key_total{outcome="outmatched"}', 0.0),
        ('llama_cache_proxy_disk_refusals_total{reason="layout"}', 0.0),
        ('llama_cache_proxy_disk_saves_total{kind="park"}', 0.0),
        ('llama_cache_proxy_forwarded_requests_total{outcome="unreachable"}', 0.0),
        ('llama_cache_proxy_state_store_errors_total{op="heartbeat"}', 0.0),
        ('llama_cache_proxy_upstream_errors_total{backend="gpu1",kind="timeout"}', 0.0),
        ('llama_cache_proxy_slots{backend="gpu0",phase="idle"}', 0.0),
        ('llama_cache_proxy_prompt_tokens_total{backend="gpu1"}', 0.0),
    ]:
        assert f"{name} {wanted}" in page, name


def test_a_label_set_asked_again_is_the_same_series() -> None:
    metrics = ProxyMetrics(CollectorRegistry())
    first = metrics.requests.labels("/completion", "200")
    assert metrics.requests.labels("/completion", "200") is first
    first.inc()
    metrics.requests.labels("/completion", 200).inc()  # (a value is its text, as before)
    metrics.requests.labels(endpoint="/completion", status="200").inc()
    metrics.requests.labels("/completion", "404").inc()
    page = generate_latest(metrics.registry).decode()
    total = "llama_cache_proxy_requests_total"
    assert f'{total}{{endpoint="/completion",status="200"}} 3.0' in page
    assert f'{total}{{endpoint="/completion",status="404"}} 1.0' in page


def test_a_removed_series_is_exported_again_when_asked_for_again() -> None:
    """A backend that runs model m0, then m1, then m0 again: its info series names m0 at the
    end (the removed child stayed cached and was exported no more)."""
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    info = metrics.backend_model
    info.labels("b", "m0").set(1)
    info.remove("b", "m0")
    info.labels("b", "m1").set(1)
    info.remove("b", "m1")
    info.labels("b", "m0").set(1)
    page = generate_latest(registry).decode()
    assert 'backend_model_info{backend="b",model="m0"} 1.0' in page
    assert 'model="m1"' not in page

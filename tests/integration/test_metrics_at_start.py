"""Every metric a shipped dashboard panel or alert reads is in /metrics right after start,
before any event: "No data" panels and alerts on increase() that miss the first event."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).parents[2] / "deploy"
NAME = re.compile(r"\bllama_cache_proxy_[a-zA-Z0-9_]+")


def _exprs(node: Any) -> list[str]:
    """Every ``expr`` string of a Grafana dashboard or a Prometheus rules file."""
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for key, v in node.items() if key != "expr" for e in _exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def used_metrics() -> set[str]:
    exprs = _exprs(yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text()))
    for path in (DEPLOY / "grafana" / "dashboards").glob("*.json"):
        exprs += _exprs(json.loads(path.read_text()))
    return {name for expr in exprs for name in NAME.findall(expr)}


def series(page: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in page.splitlines() if line[:1] != "#"}


async def test_every_metric_a_dashboard_or_alert_uses_exists_at_start(
    fakes: Any, proxy: Any
) -> None:
    used = used_metrics()
    assert {"llama_cache_proxy_queue_rejections_total", "llama_cache_proxy_slots"} <= used
    client = await proxy([await fakes()])
    page = await (await client.get("/metrics")).text()
    assert sorted(used - series(page)) == []
    # labelled counters exist at 0 for every value the code knows, before their first event
    for line in [
        'llama_cache_proxy_queue_rejections_total{reason="wait_timeout"} 0.0',
        'llama_cache_proxy_forwarded_requests_total{outcome="unreachable"} 0.0',
        'llama_cache_proxy_disk_saves_total{kind="scoped"} 0.0',
        'llama_cache_proxy_cache_key_total{outcome="reuse"} 0.0',
        'llama_cache_proxy_request_duration_seconds_count{endpoint="/v1/chat/completions"} 0.0',
    ]:
        assert line in page

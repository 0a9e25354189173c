"""A real Prometheus (Debian package) scrapes a live proxy serving a known workload through a
real llama-server; the dashboard's hit-rate PromQL returns the hit rate the responses imply."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tests.real.stack import ProxyProcess, _wait_http, free_port

BOARD = Path(__file__).parents[2] / "deploy/grafana/dashboards/llama-cache-proxy.json"


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def _hit_rate_expr() -> str:
    board = json.loads(BOARD.read_text())
    panel = next(p for p in board["panels"] if p.get("title") == "Token-weighted hit rate")
    return str(panel["targets"][0]["expr"]).replace("$__rate_interval", "1m")


def instant(port: int, expr: str) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?{query}") as resp:
        result: list[dict[str, Any]] = json.loads(resp.read())["data"]["result"]
        return result


def until_series(port: int, expr: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if instant(port, expr):
            return
        time.sleep(0.2)
    raise AssertionError(f"Prometheus never returned {expr}")


def test_dashboard_hit_rate_matches_the_workload(llama_servers: Any) -> None:
    server = llama_servers(slots=2)
    proxy = ProxyProcess([server.url]).start()
    workdir = Path(tempfile.mkdtemp(prefix="prom-"))
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "llama-cache-proxy",
                "static_configs": [{"targets": [f"127.0.0.1:{proxy.port}"]}],
            }
        ],
    }
    (workdir / "prometheus.yml").write_text(json.dumps(config))
    prometheus = subprocess.Popen(
        [
            shutil.which("prometheus") or "/usr/bin/prometheus",
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/-/ready", 60, prometheus)
        chat = proxy.url + "/v1/chat/completions"
        system = "You answer in one word. " * 30

        def ask(text: str) -> dict[str, Any]:
            body = {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": text},
                ],
                "max_tokens": 2,
                "temperature": 0,
            }
            return _post(chat, body)

        until_series(port, "up")  # Prometheus discovered the proxy and scraped it
        # the warm-up creates both series (cached > 0, so neither starts at zero: Prometheus'
        # extrapolation treats a counter that starts at 0 differently) before the first sample
        ask("warm-up")
        ask("warm-up")
        until_series(port, "llama_cache_proxy_prompt_tokens_total")
        time.sleep(1.5)
        measured = [ask("Name a color."), ask("Name a color."), ask("Name a fruit.")]
        measured.append(ask("Name a color."))
        cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in measured)
        prompt = sum(r["usage"]["prompt_tokens"] for r in measured)
        implied = cached / prompt
        time.sleep(3.0)  # at least two scrapes after the last request
        observed = float(instant(port, _hit_rate_expr())[0]["value"][1])
        assert 0.3 < implied < 1.0  # the workload has hits and misses
        assert abs(observed - implied) < 1e-6, (observed, implied, cached, prompt)
    finally:
        prometheus.terminate()
        prometheus.wait(10)
        proxy.stop()
        shutil.rmtree(workdir, ignore_errors=True)

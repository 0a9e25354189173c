"""A real Prometheus (Debian package) scrapes a live proxy serving a known workload through a
real llama-server; the dashboard's hit-rate PromQL returns the hit rate the responses imply."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from testbed.probes import metric
from testbed.stack import PrometheusServer, ProxyProcess

BOARD = Path(__file__).parents[2] / "deploy/grafana/dashboards/llama-cache-proxy.json"


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def _expr(title: str, target: int = 0, window: str = "1m") -> str:
    board = json.loads(BOARD.read_text())
    panel = next(p for p in board["panels"] if p.get("title") == title)
    return str(panel["targets"][target]["expr"]).replace("$__rate_interval", window)


def test_dashboard_hit_rate_matches_the_workload(llama_servers: Any) -> None:
    server = llama_servers(slots=2)
    proxy = ProxyProcess([server.url]).start()
    prometheus = PrometheusServer([f"127.0.0.1:{proxy.port}"])
    try:
        prometheus.start()
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

        prometheus.until("up")  # the proxy was discovered and scraped
        # the warm-up creates both series (cached > 0, so neither starts at zero: Prometheus'
        # extrapolation treats a counter that starts at 0 differently), with counts of the
        # order of the measured ones so that rate() extrapolates both counters alike
        for _ in range(3):
            ask("warm-up")
        with urllib.request.urlopen(proxy.url + "/metrics", timeout=30) as resp:
            warmed = metric(resp.read().decode(), "llama_cache_proxy_prompt_tokens_total")
        prometheus.until(f"sum(llama_cache_proxy_prompt_tokens_total) >= {warmed}")
        warmed_at = time.time()  # every sample from here on includes the whole warm-up

        def scraped_twice_since(moment: float) -> None:
            """Until Prometheus holds two samples of every series taken after ``moment``."""
            deadline = time.monotonic() + 30

            def count() -> int:
                window = f"{int(time.time() - moment)}s"  # (whole seconds: all after it)
                expr = f"count_over_time(llama_cache_proxy_prompt_tokens_total[{window}])"
                found = prometheus.query(expr) if window != "0s" else []
                return min((int(float(r["value"][1])) for r in found), default=0)

            while count() < 2:
                assert time.monotonic() < deadline, "Prometheus stopped scraping the proxy"
                time.sleep(0.2)

        scraped_twice_since(warmed_at)  # the window opens on samples of the warm-up alone
        measured = [ask("Name a color."), ask("Name a color."), ask("Name a fruit.")]
        measured.append(ask("Name a color."))
        cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in measured)
        prompt = sum(r["usage"]["prompt_tokens"] for r in measured)
        implied = cached / prompt
        scraped_twice_since(time.time())  # and closes on samples after the last request
        # the dashboard's range, cut to start after the warm-up's last sample (a sample taken
        # while the warm-up ran would count part of it as the workload's)
        window = f"{int(time.time() - warmed_at - 0.5)}s"
        observed = float(
            prometheus.query(_expr("Token-weighted hit rate", window=window))[0]["value"][1]
        )
        assert 0.3 < implied < 1.0  # the workload has hits and misses
        assert abs(observed - implied) < 1e-6, (observed, implied, cached, prompt)
        (per_model,) = prometheus.query(
            _expr("Hit rate over time: overall, per backend, per model", 2, window)
        )
        assert per_model["metric"]["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
        assert abs(float(per_model["value"][1]) - implied) < 1e-6
    finally:
        prometheus.stop()
        proxy.stop()

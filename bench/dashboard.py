"""Render the Grafana dashboard's panels from a real Prometheus, as a PNG (Grafana itself is
not installable from the package registries reachable here).

A real llama-server (SmolLM2-135M, 2 slots, ``--slot-save-path``) behind the proxy (disk tier
on, shared save directory), a real Prometheus (Debian package) scraping the proxy every
second, and an agent-like workload: sessions sharing a system prompt, interleaved, several
turns each (streamed; half with a prompt_cache_key), with one backend restart in the middle
(so the disk tier restores). Then every
panel of ``deploy/grafana/dashboards/llama-cache-proxy.json`` is evaluated over the run with
``query_range`` (``$__rate_interval`` = 15 s) and drawn: ``bench/results/dashboard.png``.

    python -m bench.dashboard [--sessions 4] [--turns 5]
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.results_io import RESULTS
from testbed.stack import LlamaServer, PrometheusServer, ProxyProcess, require_real_stack

ROOT = Path(__file__).resolve().parents[1]
BOARD = ROOT / "deploy/grafana/dashboards/llama-cache-proxy.json"


def stream(url: str, body: dict[str, Any]) -> str:
    """Send a streamed chat request (as agents do); returns the reply text."""
    data = json.dumps({**body, "stream": True}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    parts = []
    with urllib.request.urlopen(request, timeout=300) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def workload(proxy: ProxyProcess, server: LlamaServer, sessions: int, turns: int) -> None:
    system = "You are a build agent. Follow the team's rules. " + " ".join(
        f"Rule {i}: keep change {i} small and tested." for i in range(40)
    )
    histories = {
        s: [{"role": "system", "content": system}, {"role": "user", "content": f"Task {s}."}]
        for s in range(sessions)
    }
    for turn in range(turns):
        if turn == turns // 2:
            server.stop()  # a backend restart: slots empty, snapshots on disk
            server.start()
            time.sleep(1.0)
        for s in range(sessions):
            body: dict[str, Any] = {"messages": histories[s], "max_tokens": 8, "temperature": 0}
            if s % 2 == 0:
                body["prompt_cache_key"] = f"session-{s}"
            reply = stream(proxy.url + "/v1/chat/completions", body)
            histories[s] += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": f"Turn {turn}: continue."},
            ]
            time.sleep(0.5)


def legend(template: str, labels: dict[str, str]) -> str:
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out.replace("{{instance}}", "").strip() or "value"


def render(prometheus: PrometheusServer, start: float, end: float, path: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in json.loads(BOARD.read_text())["panels"] if p["type"] != "row"]
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 2.8 * rows))
    drawn = 0
    for ax, panel in zip(axes.flat, panels, strict=False):
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "15s")
            for series in prometheus.query(expr, start=start, end=end, step=1):
                points = [(float(t) - start, float(v)) for t, v in series["values"]]
                points = [(t, v) for t, v in points if v == v]  # drop NaN
                if points:
                    xs, ys = zip(*points, strict=True)
                    label = legend(target.get("legendFormat", ""), series["metric"])
                    ax.plot(xs, ys, label=label[:40])
                    drawn += 1
        ax.set_title(panel["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        if ax.lines:
            ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        "llama-cache-proxy dashboard panels (x: seconds into the run), from a real Prometheus"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    binary, model = require_real_stack()
    server = LlamaServer(binary, model, slots=2).start()
    proxy = ProxyProcess(
        [server.url],
        env={
            "LLAMA_CACHE_PROXY_DISK__SLOT_SAVE_DIR": str(server.save_dir),
            "LLAMA_CACHE_PROXY_DISK__MIN_TOKENS": "64",
            "LLAMA_CACHE_PROXY_HEALTH__INTERVAL_SECONDS": "0.5",
        },
    ).start()
    prometheus = PrometheusServer([f"127.0.0.1:{proxy.port}"])
    try:
        prometheus.start()
        prometheus.until("up")  # target discovery and a first scrape
        start = time.time()
        workload(proxy, server, args.sessions, args.turns)
        time.sleep(5)
        end = time.time()
        RESULTS.mkdir(exist_ok=True)
        drawn = render(prometheus, start, end, RESULTS / "dashboard.png")
        print(f"{drawn} series drawn over {end - start:.0f} s -> {RESULTS / 'dashboard.png'}")
    finally:
        prometheus.stop()
        proxy.stop()
        server.cleanup()


if __name__ == "__main__":
    main()

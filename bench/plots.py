"""PNG plots for benchmark results (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_replay(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    policies = [
        "ideal",
        *[
            k
            for k in rows[0]
            if k not in ("workload", "sessions", "requests", "ideal")
            and not k.endswith(("_prefill", "_seconds"))
        ],
    ]
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        ax.bar(
            [x + i * width for x in range(len(rows))],
            [r[policy] for r in rows],
            width,
            label=policy,
        )
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels([r["workload"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("token-weighted prompt-cache hit rate")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

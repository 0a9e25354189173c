"""PNG plots for benchmark results (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt


def policy_columns(row: dict[str, Any]) -> list[str]:
    """The routing policies a replay row has results for, in run order."""
    fixed = ("workload", "fleet", "sessions", "requests", "ideal", "repeats")
    ends = ("_prefill", "_seconds", "_runs", "_latency")
    return [k for k in row if k not in fixed and not k.endswith(ends)]


def plot_replay(rows: list[dict[str, Any]], path: Path) -> None:
    """Top: each policy's hit rate per workload. Bottom (when ``ours`` ran): each policy's hit
    rate minus ours in percentage points, clipped to a few points, where gaps of a tenth of a
    point (invisible on the top panel) show."""
    plt = _pyplot()
    if plt is None:
        return
    policies = ["ideal", *policy_columns(rows[0])]
    versus = "ours" in policies
    fig, axes = plt.subplots(
        2 if versus else 1, 1, figsize=(13, 8 if versus else 5), squeeze=False, sharex=True
    )
    width = 0.8 / len(policies)
    xs = range(len(rows))
    for i, policy in enumerate(policies):
        at = [x + i * width for x in xs]
        color = f"C{i % 10}"
        axes[0][0].bar(at, [r[policy] for r in rows], width, label=policy, color=color)
        if versus:
            points = [100 * (r[policy] - r["ours"]) for r in rows]
            axes[1][0].bar(at, [max(-2.0, min(1.5, p)) for p in points], width, color=color)
    axes[0][0].set_ylabel("token-weighted prompt-cache hit rate")
    axes[0][0].set_ylim(0, 1)
    axes[0][0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    bottom = axes[-1][0]
    if versus:
        bottom.axhline(0, color="black", linewidth=0.8)
        bottom.set_ylim(-2.0, 1.5)
        bottom.set_ylabel("minus ours, points (clipped to -2..1.5)")
    bottom.set_xticks([x + 0.4 - width / 2 for x in xs])
    bottom.set_xticklabels([r["workload"] for r in rows], rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_disk_window(rows: list[dict[str, Any]], path: Path) -> None:
    """Per trace: tokens per snapshot against key hit rate, one point per policy."""
    plt = _pyplot()
    if plt is None:
        return
    traces = sorted({r["trace"] for r in rows})
    fig, axes = plt.subplots(1, len(traces), figsize=(4 * len(traces), 3.6))
    for ax, trace in zip(axes, traces, strict=True):
        mine = [r for r in rows if r["trace"] == trace]
        ax.scatter([r["tokens_per_snapshot"] for r in mine], [r["key_hits"] for r in mine])
        for r in mine:
            ax.annotate(r["policy"], (r["tokens_per_snapshot"], r["key_hits"]), fontsize=8)
        ax.set_title(trace, fontsize=9)
        ax.set_xlabel("tokens per snapshot")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("key hit rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)

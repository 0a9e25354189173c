"""Compare llama.cpp's server suite run directly and through the proxy (``scripts/conformance``).

Reads the two JSON-lines files the ``llama_suite`` plugin writes (one line per test phase),
keeps each test's worst outcome, and prints a Markdown summary: tests passing directly, how
many of those pass through the proxy, and each one that does not, with the one-line cause,
marked when it is a documented deliberate refusal (``REFUSED``). Exit status 1 when a test
that passes directly fails through the proxy without being a refusal, or when refusals exceed
``MAX_REFUSED_SHARE`` of the tests passing directly.

Usage: ``python compare.py DIRECT.jsonl PROXY.jsonl [--failures FILE.md]``
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

# Tests that exercise what the proxy refuses on purpose (docs/endpoints.md), with the reason.
REFUSED: dict[str, str] = {
    "unit/test_slot_save.py::*": "POST /slots/{id} actions: the proxy manages slots itself",
    "unit/test_metrics.py::test_metrics_disabled": "/metrics serves the proxy's own metrics "
    "(200) when the backend has none (501: started without --metrics)",
    "unit/test_compat_gcp.py::*": "Google Cloud's AIP_* routes are not served",
    "unit/test_sleep.py::test_server_sleep_read_only_endpoints": "/metrics carries the "
    "proxy's own counters, which count the client's /props reads between two scrapes",
}
MAX_REFUSED_SHARE = 0.05
_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def outcomes(path: Path) -> dict[str, tuple[str, str]]:
    """Test id -> (worst outcome, its cause) over the test's phases."""
    found: dict[str, tuple[str, str]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        old = found.get(row["test"])
        if old is None or _RANK[row["outcome"]] > _RANK[old[0]]:
            found[row["test"]] = (row["outcome"], row["cause"])
    return found


def refusal(test: str) -> str | None:
    for pattern, reason in REFUSED.items():
        if fnmatch.fnmatchcase(test, pattern):
            return reason
    return None


def summarize(
    direct: dict[str, tuple[str, str]], proxied: dict[str, tuple[str, str]]
) -> dict[str, Any]:
    passing = sorted(t for t, (o, _) in direct.items() if o == "passed" and t in proxied)
    lost = [t for t in passing if proxied[t][0] != "passed"]
    refused = [t for t in lost if refusal(t)]
    return {
        "run": len(direct),
        "not_run_through_proxy": len(direct.keys() - proxied.keys()),
        "skipped": sum(o == "skipped" for o, _ in direct.values()),
        "failed_directly": sum(o in ("failed", "error") for o, _ in direct.values()),
        "passing": passing,
        "through_proxy": len(passing) - len(lost),
        "refused": refused,
        "failing": [t for t in lost if t not in refused],
        "gained": sorted(
            t
            for t, (o, _) in proxied.items()
            if o == "passed" and direct.get(t, ("",))[0] != "passed"
        ),
    }


def report(summary: dict[str, Any], proxied: dict[str, tuple[str, str]]) -> str:
    passing = len(summary["passing"]) or 1
    lines = [
        "| tests | count |",
        "| --- | ---: |",
        f"| run (not deselected) | {summary['run']} |",
        f"| skipped (need another model or a download) | {summary['skipped']} |",
        f"| fail directly (SmolLM2, not the suite's models) | {summary['failed_directly']} |",
        f"| not run through the proxy (a partial run) | {summary['not_run_through_proxy']} |",
        f"| **pass directly** (and ran through the proxy) | **{len(summary['passing'])}** |",
        f"| **of those, pass through the proxy** | **{summary['through_proxy']}** |",
        f"| refused on purpose | {len(summary['refused'])} "
        f"({100 * len(summary['refused']) / passing:.1f} %) |",
        f"| other failures through the proxy | {len(summary['failing'])} |",
        f"| fail directly, pass through the proxy | {len(summary['gained'])} |",
    ]
    causes = Counter(_cause_kind(proxied[t][1]) for t in summary["failing"])
    if causes:
        lines += ["", "Failures through the proxy by cause:", ""]
        lines += [f"- {n}: {cause}" for cause, n in causes.most_common()]
    return "\n".join(lines) + "\n"


def failure_list(summary: dict[str, Any], proxied: dict[str, tuple[str, str]]) -> str:
    rows = [f"- `{t}`: {proxied[t][1]}" for t in summary["failing"]]
    rows += [f"- `{t}` (refused on purpose: {refusal(t)})" for t in summary["refused"]]
    return "\n".join(rows or ["(none)"]) + "\n"


def _cause_kind(cause: str) -> str:
    return cause.split(" + where")[0][:120]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("direct", type=Path)
    parser.add_argument("proxy", type=Path)
    parser.add_argument("--failures", type=Path, help="write the failing tests here (Markdown)")
    args = parser.parse_args(argv)
    direct, proxied = outcomes(args.direct), outcomes(args.proxy)
    summary = summarize(direct, proxied)
    print(report(summary, proxied))
    if args.failures:
        args.failures.write_text(
            "Tests of llama.cpp's server suite that pass against llama-server directly and fail "
            "through the proxy (cause: the first line of the failure).\n\n"
            + report(summary, proxied)
            + "\n"
            + failure_list(summary, proxied)
        )
    too_many = len(summary["refused"]) > MAX_REFUSED_SHARE * len(summary["passing"])
    return 1 if summary["failing"] or too_many else 0


if __name__ == "__main__":
    sys.exit(main())

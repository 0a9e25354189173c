"""Where benchmarks keep their results, and how they print them: JSON files under
``bench/results`` and Markdown tables on stdout (pasted into the README as they are)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def save(name: str, data: Any) -> Path:
    """Write ``data`` to ``bench/results/{name}.json``; returns the path."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1))
    return path


def load(name: str) -> Any:
    return json.loads((RESULTS / f"{name}.json").read_text())


def print_markdown(header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """A Markdown table: the header, its rule, one line per row of already formatted cells."""
    print("| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")

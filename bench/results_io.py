"""Where benchmarks keep their results, and how they print them: JSON files under
``bench/results`` and Markdown tables on stdout (pasted into the README as they are)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def path_of(name: str) -> Path:
    """``name``: a stem under ``bench/results``, or a path (with a ``/``) as given."""
    path = Path(name) if "/" in name else RESULTS / name
    return path if path.suffix == ".json" else path.with_name(path.name + ".json")


def save(name: str, data: Any) -> Path:
    """Write ``data`` to ``bench/results/{name}.json`` (or the path ``name``); returns it."""
    path = path_of(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


def load(name: str) -> Any:
    return json.loads(path_of(name).read_text())


def measured(name: str, from_json: bool, run: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """The saved result (``--from-json``: reprint it), or a new run of ``run``, saved."""
    if from_json:
        return load(name)
    result: Any = asyncio.run(run())
    save(name, result)
    return result


def print_markdown(header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """A Markdown table: the header, its rule, one line per row of already formatted cells."""
    print("| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")

"""Where benchmarks keep their results, and how they print them: JSON files under
``bench/results`` and Markdown tables on stdout (pasted into docs/benchmarks.md as they are).

Every result ``save`` writes carries its provenance: ``commit`` (git HEAD, ``-dirty`` when
tracked files differ from it), ``command`` (the command line that ran), ``machine`` and
``date`` (UTC). A result named NAME goes to ``bench/results/NAME/YYYYMMDD-COMMIT.json``
(``-2``, ``-3`` ... when that file exists); results from before that layout are
``bench/results/NAME.json``. ``load`` reads the newest of either. A result that is a list
of rows is stored as an object with the provenance and ``rows``; ``rows_of`` gives the list.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]
PROVENANCE = ("commit", "command", "machine", "date")
invocation: str | None = None  # the command line, when ``python -m bench NAME`` dispatched


def head_commit() -> str:
    """git HEAD, with ``-dirty`` when a tracked file differs from it; ``unknown`` without git."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT).returncode
    return head.stdout.strip() + ("-dirty" if changed == 1 else "")


def command_line() -> str:
    """The running command, as ``python -m bench.NAME ...`` (or as ``bench/__main__`` got it)."""
    if invocation is not None:
        return invocation
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name:
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        head = ["python", sys.argv[0]]
    return shlex.join([*head, *sys.argv[1:]])


def provenance() -> dict[str, Any]:
    machine = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {"commit": head_commit(), "command": command_line(), "machine": machine, "date": now}


def machine_line() -> str:
    """The machine and commit a result is measured on, for the line above its table."""
    return (
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; commit {head_commit()[:7]}"
    )


def _explicit(name: str) -> Path | None:
    """``name`` as a file path (it has a ``/`` or ends in ``.json``), else None."""
    if "/" not in name and not name.endswith(".json"):
        return None
    path = Path(name)
    return path if path.suffix == ".json" else path.with_name(path.name + ".json")


def _new_path(name: str, record: dict[str, Any]) -> Path:
    explicit = _explicit(name)
    if explicit is not None:
        return explicit
    commit = str(record["commit"])
    stem = record["date"][:10].replace("-", "") + "-" + commit[:7]
    stem += "-dirty" if commit.endswith("-dirty") else ""
    path, n = RESULTS / name / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = RESULTS / name / f"{stem}-{n}.json"
    return path


def latest(name: str) -> Path:
    """The file ``load(name)`` reads: the path ``name``, the newest (by recorded date) under
    ``bench/results/{name}/``, or ``bench/results/{name}.json``."""
    explicit = _explicit(name)
    if explicit is not None:
        return explicit
    runs = sorted((RESULTS / name).glob("*.json"))
    if runs:
        return max(runs, key=lambda path: (json.loads(path.read_text()).get("date", ""), path.name))
    return RESULTS / f"{name}.json"


def save(name: str, data: Any) -> Path:
    """Write ``data`` with its provenance (see the module's doc) and return the file's path.
    ``name``: a results name, or a file path (with a ``/``, or ending in ``.json``)."""
    record = provenance()
    body = data if isinstance(data, dict) else {"rows": data}
    if clash := set(PROVENANCE) & body.keys():
        raise ValueError(f"{sorted(clash)} are set by results_io.save, not by the benchmark")
    path = _new_path(name, record)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**record, **body}, indent=1))
    print(f"results: {path}", file=sys.stderr)
    return path


def load(name: str) -> Any:
    return json.loads(latest(name).read_text())


def rows_of(result: Any) -> Any:
    """The rows of a saved list result (``result`` itself if it is a bare list)."""
    return result["rows"] if isinstance(result, dict) else result


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

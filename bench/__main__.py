"""One entry point for the benchmarks: ``python -m bench NAME [args]`` runs ``bench.NAME``'s
``main()`` with ``args``, as ``python -m bench.NAME [args]`` does; ``python -m bench`` lists
them. A result a benchmark saves records this command line (``bench.results_io``)."""

from __future__ import annotations

import ast
import importlib
import shlex
import sys
from pathlib import Path

from bench import results_io

WIDTH = 96


def _summary(doc: str) -> str:
    """A docstring's first sentence on one line, cut to ``WIDTH`` characters."""
    text = " ".join(doc.split("\n\n")[0].split())
    sentence = text.split(". ")[0].removesuffix(".")
    return sentence if len(sentence) <= WIDTH else sentence[: WIDTH - 1].rsplit(" ", 1)[0] + "…"


def benchmarks() -> dict[str, str]:
    """The modules of ``bench`` with a top-level ``main()``, each with its summary (read from
    the source, so listing imports none of them)."""
    found = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        if not path.stem.startswith("_") and any(
            isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body
        ):
            found[path.stem] = _summary(ast.get_docstring(tree) or "")
    return found


def main() -> None:
    found = benchmarks()
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print("usage: python -m bench NAME [args]  (python -m bench NAME --help: its options)\n")
        width = max(map(len, found))
        for name, summary in found.items():
            print(f"  {name:<{width}}  {summary}")
        return
    name = sys.argv[1]
    if name not in found:
        sys.exit(f"no benchmark {name!r}; python -m bench lists them")
    results_io.invocation = shlex.join(["python", "-m", "bench", *sys.argv[1:]])
    sys.argv = [f"python -m bench {name}", *sys.argv[2:]]
    importlib.import_module(f"bench.{name}").main()


if __name__ == "__main__":
    main()

"""The conformance harness's verdict (tests/conformance/compare.py): direct vs proxied runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parents[1] / "conformance" / "compare.py"


def _compare() -> ModuleType:
    spec = importlib.util.spec_from_file_location("conformance_compare", HERE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    lines = [json.dumps({"test": t, "outcome": o, "cause": c, "s": 0.1}) for t, o, c in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    direct = _write(
        tmp_path / "direct.jsonl",
        [("a", "passed", ""), ("b", "passed", ""), ("c", "failed", "model"), ("d", "skipped", "")],
    )
    proxied = _write(
        tmp_path / "proxy.jsonl",
        [("a", "passed", ""), ("b", "passed", ""), ("b", "error", "teardown: boom"),
         ("c", "passed", ""), ("d", "skipped", "")],
    )  # fmt: skip
    return direct, proxied


def test_a_test_passing_directly_and_failing_through_the_proxy_fails_the_run(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    compare = _compare()
    failures = tmp_path / "failures.md"
    assert compare.main([str(runs[0]), str(runs[1]), "--failures", str(failures)]) == 1
    assert "- `b`: teardown: boom" in failures.read_text()  # the worst phase counts
    out = capsys.readouterr().out
    assert "| **pass directly** (and ran through the proxy) | **2** |" in out
    assert "| **of those, pass through the proxy** | **1** |" in out
    assert "| fail directly, pass through the proxy | 1 |" in out


def test_a_documented_refusal_within_the_share_passes_and_beyond_it_fails(
    runs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    compare = _compare()
    monkeypatch.setattr(compare, "REFUSED", {"b": "refused on purpose"})
    assert compare.main([str(runs[0]), str(runs[1])]) == 1  # 1 of 2 is over 5 %
    monkeypatch.setattr(compare, "MAX_REFUSED_SHARE", 0.5)
    assert compare.main([str(runs[0]), str(runs[1])]) == 0

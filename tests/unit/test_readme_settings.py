"""The README's configuration table lists every setting of the settings tree with its default,
and names no setting that does not exist.

A setting is a dotted path through ``proxy.config.settings.Settings``
(``routing.min_prefix_tokens``); the fields of each backend are ``backends[].NAME``. A row's default
cell starts with the default as the table writes it (``null``, ``true``, ``16``, ``0.5``, ``auto``,
``[a, b]``), or says ``(required)``; its unit cell is never empty.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel

from proxy.config.settings import Settings

README = Path(__file__).parents[2] / "README.md"
ROW = re.compile(r"^\|\s*`(?P<name>[a-z_\[\].]+)`\s*\|(?P<default>[^|]*)\|(?P<unit>[^|]*)\|")
REQUIRED = "(required)"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The settings section a field holds: itself, or the element of a tuple of them."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def settings(model: type[BaseModel] = Settings, prefix: str = "") -> dict[str, object]:
    """Every leaf setting's dotted path and its default (``REQUIRED`` when it has none)."""
    out: dict[str, object] = {}
    for name, info in model.model_fields.items():
        section = _model_in(info.annotation)
        if section is not None:
            many = section is not info.annotation  # a tuple of sections: backends[]
            out |= settings(section, f"{prefix}{name}{'[]' if many else ''}.")
        elif info.is_required():
            out[prefix + name] = REQUIRED
        else:
            out[prefix + name] = info.get_default(call_default_factory=True)
    return out


def written(value: object) -> str:
    """A default as the table writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(written(item) for item in value) + "]"
    return str(value)


def table() -> dict[str, tuple[str, str]]:
    """The configuration section's rows: setting -> (default cell, unit cell)."""
    text = README.read_text()
    start = text.index("\n## Configuration\n")
    end = text.find("\n## ", start + 1)
    rows: dict[str, tuple[str, str]] = {}
    for line in text[start : end if end > 0 else None].splitlines():
        match = ROW.match(line)
        if match:
            assert match["name"] not in rows, f"{match['name']} is listed twice"
            rows[match["name"]] = (match["default"].strip(), match["unit"].strip())
    return rows


def test_the_walk_reaches_nested_sections_and_each_backends_fields() -> None:
    found = settings()
    assert found["routing.min_prefix_tokens"] == 16
    assert found["backends[].url"] == REQUIRED
    assert found["disk.max_bytes"] == 20 * 1024**3
    assert "backends" not in found
    assert "routing" not in found


def test_readme_table_names_exactly_the_settings() -> None:
    rows, known = table(), settings()
    assert sorted(set(known) - set(rows)) == [], "settings missing from the README's table"
    assert sorted(set(rows) - set(known)) == [], "README's table names settings that do not exist"


def test_readme_table_gives_each_default_and_a_unit() -> None:
    rows = table()
    for name, default in settings().items():
        assert name in rows, f"{name}: not in the README's table"
        cell, unit = rows[name]
        assert unit, f"{name}: no unit"
        if default == REQUIRED:
            assert cell == REQUIRED, f"{name}: {cell!r} should say {REQUIRED}"
            continue
        first = re.match(r"`([^`]*)`", cell)
        assert first, f"{name}: the default cell {cell!r} does not start with a `value`"
        assert first[1] == written(default), (
            f"{name}: README says {first[1]}, the default is {written(default)}"
        )

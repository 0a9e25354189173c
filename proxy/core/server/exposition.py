"""Backends' Prometheus text pages (exposition format 0.0.4) appended to the proxy's own.

``combine`` takes each answering backend's page with its label. Unlabelled (one backend
configured) the pages are returned verbatim, so a dashboard or test written for
llama-server reads the proxy's ``/metrics`` unchanged.

Labelled (several backends), the pages are merged so that the result is still one valid
page. Each page is read line by line into metric families: a ``# HELP`` or ``# TYPE`` line
names the current family; a sample belongs to it when the sample's name is that name or that
name plus a series suffix (``_total``, ``_bucket``, ``_count``, ``_sum``, ``_created``,
``_info``), else it is a family of its own name. Families are written in the order they first
appear over the pages, each with the first ``# HELP`` and ``# TYPE`` line any page gave it
(a family's lines appear once, as the format requires), then the samples of every page in
page order. Each sample gets ``backend="<label>"`` first in its label set (the value escaped
as the format requires: backslash, double quote, newline); a ``backend`` label the sample
already has is kept as ``exported_backend`` (what Prometheus does with a clashing target
label). The value and an optional timestamp after the labels are kept as written. Other
comments, blank lines and lines that are not samples carry no data and are dropped.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

_NAME = r"([a-zA-Z_:][a-zA-Z0-9_:]*)"
_LABELS = r'(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?'
_VALUE = r"(\s+[-+]?(?:[0-9.]+(?:[eE][-+]?[0-9]+)?|(?i:inf|nan))(?:\s+-?[0-9]+)?\s*)"
_SAMPLE = re.compile(_NAME + _LABELS + _VALUE)  # name, label set, value [timestamp]
_PAIR = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*("(?:[^"\\]|\\.)*")\s*,?')
_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created", "_info")
LABEL = "backend"


@dataclass
class _Family:
    help: str | None = None
    type: str | None = None
    samples: list[str] = field(default_factory=list)


def combine(pages: Sequence[tuple[str, str]], *, labelled: bool) -> str:
    """``pages``: (backend label, page text) in backend order."""
    if not labelled:
        return "".join(text if text.endswith("\n") else text + "\n" for _, text in pages)
    families: dict[str, _Family] = {}
    for label, text in pages:
        _read(text, label, families)
    lines: list[str] = []
    for family in families.values():
        lines += [line for line in (family.help, family.type) if line is not None]
        lines += family.samples
    return "".join(line + "\n" for line in lines)


def _read(text: str, label: str, families: dict[str, _Family]) -> None:
    current = ""
    for line in text.splitlines():
        parts = line.split(None, 3)
        if len(parts) >= 3 and parts[0] == "#" and parts[1] in ("HELP", "TYPE"):
            current = parts[2]
            family = families.setdefault(current, _Family())
            if parts[1] == "HELP" and family.help is None:
                family.help = line
            elif parts[1] == "TYPE" and family.type is None:
                family.type = line
            continue
        match = _SAMPLE.fullmatch(line)
        if line.startswith("#") or match is None:
            continue
        name, labels, rest = match.groups()
        owner = current if _belongs(name, current) else name
        families.setdefault(owner, _Family()).samples.append(
            name + _with_label(labels or "{}", label) + rest
        )


def _belongs(name: str, family: str) -> bool:
    return bool(family) and (name == family or name in (family + s for s in _SUFFIXES))


def _with_label(labels: str, label: str) -> str:
    """``{a="b"}`` -> ``{backend="<label>",a="b"}``."""
    pairs = [
        ("exported_" + key if key == LABEL else key, value)
        for key, value in _PAIR.findall(labels[1:-1])
    ]
    pairs.insert(0, (LABEL, f'"{escape(label)}"'))
    return "{" + ",".join(f"{key}={value}" for key, value in pairs) + "}"


def escape(value: str) -> str:
    """A label value as the text format writes it inside double quotes."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

"""Where settings come from before they are validated: a YAML, TOML or JSON file and
``LLAMA_CACHE_PROXY_*`` environment variables, merged into one mapping (``proxy.config.settings``
validates it)."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "LLAMA_CACHE_PROXY_"


class ConfigError(Exception):
    """Invalid configuration; ``str()`` is one line naming the offending field."""


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a YAML (``.yaml``/``.yml``), TOML (``.toml``) or JSON file into a dict."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config: {path} is not UTF-8 text (save it as UTF-8)") from None
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        mark = getattr(exc, "problem_mark", None)  # (YAML: where, and what went wrong)
        if mark is not None:
            problem = getattr(exc, "problem", None) or first
            first = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
        raise ConfigError(f"config: {path} is not valid: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping at the top level")
    return data


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``LLAMA_CACHE_PROXY_A__B=v`` -> ``{"a": {"b": "v"}}`` (the CONFIG variable excluded)."""
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key == ENV_PREFIX + "CONFIG":
            continue
        path = key[len(ENV_PREFIX) :].lower().split("__")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):  # (A=x and A__B=y: one value and one section)
                raise ConfigError(f"config: {key} and a variable setting all of it conflict")
        if isinstance(node.get(path[-1]), dict):
            raise ConfigError(f"config: {key} and a variable setting part of it conflict")
        node[path[-1]] = value
    return out


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged

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


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping: the first value
    would be dropped without a word (TOML refuses it too; JSON: ``_unique``)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # ``<<: *base``: its keys may be given again, that is what it is for
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _Twice(ValueError):
    """A JSON object with a key given twice."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (``json.loads``' ``object_pairs_hook``)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Twice(f"key {key!r} given twice")
        out[key] = value
    return out


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a YAML (``.yaml``/``.yml``), TOML (``.toml``) or JSON file into a dict; a key
    given twice in one mapping is an error, not the last one silently kept."""
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
            data = json.loads(text, object_pairs_hook=_unique)
        else:
            data = yaml.load(text, Loader=_Loader)
    except _Twice as exc:
        raise ConfigError(f"config: {path} is not valid: {exc}") from None
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

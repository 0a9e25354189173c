"""``serve`` runs on uvloop where it is installed, and on asyncio's own loop otherwise."""

from __future__ import annotations

import asyncio
import builtins
from typing import Any

import pytest

from proxy.cli import event_loop


def test_serve_runs_on_uvloop_where_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    loop = event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
        assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
    finally:
        loop.close()


def test_serve_falls_back_to_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def without_uvloop(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "uvloop":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_uvloop)
    loop = event_loop()
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()

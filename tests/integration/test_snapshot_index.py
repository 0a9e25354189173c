"""The snapshot index's file work (``proxy.disk.index``): off the event loop, and a
periodic reconcile that survives a failed round."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import proxy.disk.index
from proxy.core.disk.snapshots import Layout, Snapshot, file_name, touched
from proxy.core.server.fleet import Fleet
from proxy.disk.index import SnapshotIndex
from proxy.metrics import ProxyMetrics
from proxy.replicas.shared_state import SharedState
from proxy.state import InMemoryStateStore
from tests.integration.test_disk_fake import snapshot_files

LAYOUT = Layout(model="m.gguf", ftype="Q8_0", n_ctx=4096, slots=1)
DIRECTORY = "dir:save"


def snapshot(chain: int, nbytes: int, last_used: float) -> Snapshot:
    return Snapshot(
        name=file_name(LAYOUT, chain),
        directory=DIRECTORY,
        chain=chain,
        segments=1,
        tokens=100,
        estimate=100,
        nbytes=nbytes,
        layout=LAYOUT,
        created=last_used,
        last_used=last_used,
    )


def make_index(tmp_path: Path, budget: int) -> SnapshotIndex:
    metrics = ProxyMetrics(CollectorRegistry())
    shared = SharedState(InMemoryStateStore(), Fleet(["b"]), metrics, time.time, enabled=True)
    return SnapshotIndex(shared, metrics, budget, lambda d: tmp_path if d == DIRECTORY else None)


def on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def test_deleting_and_checking_files_runs_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = make_index(tmp_path, budget=5000)
    old, new = snapshot(1, 4000, 100.0), snapshot(2, 4000, 200.0)
    for entry in (old, new):
        (tmp_path / entry.name).write_bytes(b"x" * 4000)
        await index.put(entry)
    stray = tmp_path / file_name(LAYOUT, 3)
    stray.write_bytes(b"x" * 4000)
    os.utime(stray, (0, 0))  # long past the grace period
    calls: list[tuple[str, bool]] = []  # (what, on the loop) for paths in tmp_path

    def watch(name: str, real: Any) -> Any:
        def wrapped(path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path).startswith(str(tmp_path)):
                calls.append((name, on_loop()))
            return real(path, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(os, "remove", watch("remove", os.remove))
    monkeypatch.setattr(Path, "resolve", watch("resolve", Path.resolve))
    monkeypatch.setattr(Path, "is_file", watch("is_file", Path.is_file))
    assert await index.enforce_budget(DIRECTORY) == 2  # the stray, then the older snapshot
    assert await index.file_exists(new) is True
    assert await index.file_exists(old) is False
    monkeypatch.undo()
    assert snapshot_files(tmp_path) == {new.name}
    assert {name for name, _ in calls} == {"remove", "resolve", "is_file"}
    assert [name for name, looping in calls if looping] == []


async def test_a_failed_reconcile_round_is_logged_and_the_next_one_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    index = make_index(tmp_path, budget=5000)
    rounds: list[int] = []
    second = asyncio.Event()
    real = index.reconcile

    async def reconcile(directories: Any) -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise RuntimeError("the store answered nonsense")
        await real(directories)
        second.set()

    monkeypatch.setattr(index, "reconcile", reconcile)
    with caplog.at_level(logging.ERROR, logger=proxy.disk.index.__name__):
        task = asyncio.create_task(index.maintain([DIRECTORY], every=0.01))
        await asyncio.wait_for(second.wait(), timeout=5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert len(rounds) >= 2
    assert "reconciling the save directories failed" in caplog.text
    assert "the store answered nonsense" in caplog.text


async def test_a_restore_judged_after_its_snapshot_was_evicted_does_not_list_it_again(
    tmp_path: Path,
) -> None:
    """A request restores ``old``; meanwhile another save's budget check evicts it and
    deletes its file. The restore is then judged a hit: touched, it was listed again as the
    newest entry, with no file behind it, and the next budget check deleted a real file."""
    index = make_index(tmp_path, budget=5000)
    old, new = snapshot(1, 4000, 100.0), snapshot(2, 4000, 200.0)
    for entry in (old, new):
        (tmp_path / entry.name).write_bytes(b"x" * 4000)
    await index.put(old)
    await index.put(new)
    assert await index.enforce_budget("dir:save") == 1  # old goes
    await index.update(touched(old, 300.0))  # the restore's judgement, late
    assert [e.name for e in await index.all() or []] == [new.name]
    await index.update(touched(new, 400.0))  # (one still listed is touched)
    assert [e.last_used for e in await index.all() or []] == [400.0]
    assert (tmp_path / new.name).exists()

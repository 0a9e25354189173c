"""What a replica believes of the store's list of replicas, and the background task that
reads it: no entry a store writer adds stops either."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.core.replicas import auth
from proxy.core.replicas.auth import sign_entry
from proxy.core.server.fleet import Fleet
from proxy.metrics import ProxyMetrics
from proxy.replicas import roster
from proxy.replicas.roster import Roster
from proxy.replicas.shared_state import SharedState
from proxy.state import InMemoryStateStore
from proxy.state.base import Beat
from tests.waiting import until

KEY = b"replicas' shared secret"
UNDECODABLE = "x|99999999999|\ufffd"  # b"x|99999999999|\xff" as the store's reply is decoded


def _roster() -> tuple[Roster, ProxyMetrics]:
    metrics = ProxyMetrics(CollectorRegistry())
    return Roster("me", KEY, metrics, time.time), metrics


def test_an_entry_with_an_undecodable_signature_is_refused_not_an_error() -> None:
    """``hmac.compare_digest`` raised TypeError on the non-ASCII text, out of the read."""
    mine, metrics = _roster()
    peer = sign_entry(KEY, "peer", 1000.0)
    live, _, _ = mine.read(Beat(10.0, [(UNDECODABLE, 20.0), (peer, 20.0)]), "me", 1.0)
    assert live == ["peer"]
    assert metrics.replicas_rejected._value.get() == 1


def test_an_entry_whose_check_raises_is_refused_and_the_rest_are_read(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = auth.verify_entry  # what the roster calls

    def failing(secret: bytes, entry: str, score: float) -> str | None:
        if entry == "bad":
            raise RuntimeError("a bug")
        return real(secret, entry, score)

    monkeypatch.setattr(roster, "verify_entry", failing)
    mine, metrics = _roster()
    peer = sign_entry(KEY, "peer", 1000.0)
    live, _, _ = mine.read(Beat(10.0, [("bad", 20.0), (peer, 20.0)]), "me", 1.0)
    assert live == ["peer"]
    assert metrics.replicas_rejected._value.get() == 1
    assert "cannot check replica entry 'bad'" in caplog.text


class Poisoned(InMemoryStateStore):
    """A store whose replica list holds an undecodable entry; ``fail`` heartbeats raise."""

    def __init__(self, fail: int = 0) -> None:
        super().__init__()
        self.beats, self.renewals, self.fail = 0, 0, fail

    async def heartbeat(self, owner: str, ttl: float, now: float, *rest: Any) -> Beat:
        self.beats += 1
        if self.beats <= self.fail:
            raise RuntimeError("a round that fails")
        beat = await super().heartbeat(owner, ttl, now, *rest)
        return Beat(beat.now, [*beat.entries, (UNDECODABLE, now + 10**6)])

    async def renew_lease(self, ref: Any, owner: str, ttl: float, now: float) -> bool:
        self.renewals += 1
        return True


async def _run(store: Poisoned) -> asyncio.Task[None]:
    metrics = ProxyMetrics(CollectorRegistry())
    shared = SharedState(store, Fleet(["b"]), metrics, time.time, enabled=True, secret=KEY)
    shared._held.add(("b", 0))  # a lease it keeps renewing
    task = asyncio.create_task(shared.maintain(lambda: None, every=0.01))
    await until(lambda: store.beats >= 6 or task.done(), "six maintenance rounds")
    shared.stopped = True
    await asyncio.wait([task], timeout=1.0)
    return task


async def test_an_undecodable_entry_in_the_store_does_not_end_maintenance() -> None:
    """The TypeError it raised ended the background task: leases stopped renewing."""
    store = Poisoned()
    task = await _run(store)
    assert task.done()
    assert task.exception() is None
    assert store.beats >= 6
    assert store.renewals >= 6


async def test_a_round_that_raises_is_logged_once_and_the_next_rounds_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = Poisoned(fail=3)
    with caplog.at_level(logging.ERROR, "proxy.replicas.shared_state"):
        task = await _run(store)
    assert task.done()
    assert task.exception() is None
    assert store.beats >= 6
    assert store.renewals >= 6
    failed = [r for r in caplog.records if "maintenance round failed" in r.message]
    assert len(failed) == 1
    assert failed[0].exc_info is not None

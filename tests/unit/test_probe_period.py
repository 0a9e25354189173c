"""The probe loop's period (``backends.health.Prober.run``): a round that waits for a backend
that never answers (up to the probe timeout) does not stretch the period of the next."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
from prometheus_client import CollectorRegistry

from proxy.backends.health import Prober
from proxy.backends.scheduler import Scheduler
from proxy.core.server.fleet import Fleet
from proxy.metrics import ProxyMetrics
from tests.conftest import make_settings


async def test_the_next_round_starts_an_interval_after_the_last_one_started() -> None:
    settings = make_settings(["http://127.0.0.1:9"], health={"interval_seconds": 2.0})
    metrics = ProxyMetrics(CollectorRegistry())
    now = [0.0]
    scheduler = Scheduler(Fleet(["b"]), settings.queue, metrics, lambda: now[0])
    prober = Prober(settings, mock.Mock(), scheduler, metrics, lambda: now[0])
    slept: list[float] = []

    rounds = iter([0.5, 3.0, 0.0])

    async def probe_all() -> None:
        now[0] += next(rounds)  # the second: a hung backend's probe times out after 3 s

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds
        if len(slept) == 3:
            raise asyncio.CancelledError

    with (
        mock.patch.object(prober, "probe_all", probe_all),
        mock.patch("proxy.backends.health.asyncio.sleep", sleep),
        pytest.raises(asyncio.CancelledError),
    ):
        await prober.run()
    assert slept == [1.5, 0.0, 2.0]

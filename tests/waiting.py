"""Waiting in tests for something to happen: poll for it, and fail naming what never did.

A fixed sleep guesses how long a thing takes: too short on a busy machine (the test fails),
too long on an idle one (the suite is slow). These return as soon as the condition holds.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from testbed.probes import metric

T = TypeVar("T")
ADMIN = "the tests' admin token"  # a proxy started with admin_token=ADMIN shows its slot table
PLACED = "llama_cache_proxy_slot_wait_seconds_count"  # observed as a request takes its slot


async def until(
    condition: Callable[[], bool | Awaitable[bool]],
    what: str = "the condition",
    within: float = 10.0,
    every: float = 0.02,
) -> None:
    """Until ``condition()`` (a plain or an async predicate) is true; an AssertionError
    naming ``what`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        assert time.monotonic() < deadline, f"{what}: not within {within} s"
        await asyncio.sleep(every)


class Remote:
    """A proxy process (or any server) at ``url`` read as the helpers read a test client:
    ``get(path)`` returns the response, its body read (so it can be awaited again)."""

    def __init__(self, session: Any, url: str) -> None:
        self.session, self.url = session, url

    async def get(self, path: str, **kwargs: Any) -> Any:
        async with self.session.get(self.url + path, **kwargs) as resp:
            await resp.read()
            return resp


async def scrape(client: Any, name: str, **labels: str) -> float:
    """``metric`` of a proxy's ``/metrics`` page, read through its test client."""
    return metric(await (await client.get("/metrics")).text(), name, **labels)


async def until_metric(
    client: Any, name: str, want: Callable[[float], bool], within: float = 10.0, **labels: str
) -> None:
    """Until the proxy's ``name`` (summed over ``labels``) satisfies ``want``."""

    async def holds() -> bool:
        return want(await scrape(client, name, **labels))

    await until(holds, f"{name}{labels or ''}", within)


async def once_placed(request: Coroutine[Any, Any, T], *replicas: Any) -> asyncio.Task[T]:
    """``request`` as a task, once one of the proxy ``replicas`` (test clients; the one it is
    sent to, and any it may be forwarded to) has given it a slot: what the backend runs next
    is behind it."""

    async def placed() -> float:
        return sum([await scrape(r, PLACED) for r in replicas])

    before = await placed()
    task = asyncio.create_task(request)

    async def more() -> bool:
        return await placed() > before

    await until(more, "the request is given a slot")
    return task


async def until_down(client: Any, server: Any) -> None:
    """Until the proxy behind ``client`` no longer holds the backend ``server`` (a fake or a
    real llama-server) ready."""
    label = server.url.removeprefix("http://")

    async def down() -> bool:
        resp = await client.get("/readyz")
        return resp.status != 200 or label not in (await resp.json())["backends"]

    await until(down, f"the proxy sees {label} go")


async def until_ready(client: Any, within: float = 10.0) -> None:
    """Until the proxy behind ``client`` holds a backend ready (``/readyz`` answers 200)."""

    async def ready() -> bool:
        return bool((await client.get("/readyz")).status == 200)

    await until(ready, "the proxy holds a backend ready", within)


async def admin_view(client: Any, server: Any) -> dict[str, Any]:
    """The backend ``server`` as the proxy behind ``client`` sees it: its phase and its slots
    (``/admin/slots``; the proxy was started with ``admin_token=ADMIN``)."""
    label = server.url.removeprefix("http://")
    resp = await client.get("/admin/slots", headers={"Authorization": f"Bearer {ADMIN}"})
    (backend,) = [b for b in (await resp.json())["backends"] if b["label"] == label]
    return dict(backend)

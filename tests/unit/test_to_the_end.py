"""``to_the_end``: bookkeeping after a complete response survives the client leaving."""

from __future__ import annotations

import asyncio

import pytest

from proxy.http.streaming import to_the_end


async def test_work_finishes_and_handler_returns_when_cancelled_meanwhile() -> None:
    done: list[str] = []
    started, finish = asyncio.Event(), asyncio.Event()

    async def bookkeeping() -> str:
        started.set()
        await finish.wait()
        done.append("recorded")
        return "ok"

    async def handler() -> str:
        return await to_the_end(bookkeeping())

    task = asyncio.create_task(handler())
    await started.wait()
    task.cancel()  # what aiohttp does when the client closes its connection
    await asyncio.sleep(0)  # the cancel lands while the work runs
    assert not task.done()
    finish.set()
    assert await task == "ok"
    assert done == ["recorded"]


async def test_cancelled_work_itself_still_cancels() -> None:
    async def bookkeeping() -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await to_the_end(bookkeeping())

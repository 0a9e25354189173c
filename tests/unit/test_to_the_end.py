"""``to_the_end``: bookkeeping after a complete response survives the client leaving."""

from __future__ import annotations

import asyncio

import pytest

from proxy.streaming import to_the_end


async def test_work_finishes_and_handler_returns_when_cancelled_meanwhile() -> None:
    done: list[str] = []

    async def bookkeeping() -> str:
        await asyncio.sleep(0.05)
        done.append("recorded")
        return "ok"

    async def handler() -> str:
        return await to_the_end(bookkeeping())

    task = asyncio.create_task(handler())
    await asyncio.sleep(0.01)
    task.cancel()  # what aiohttp does when the client closes its connection
    assert await task == "ok"
    assert done == ["recorded"]


async def test_cancelled_work_itself_still_cancels() -> None:
    async def bookkeeping() -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await to_the_end(bookkeeping())

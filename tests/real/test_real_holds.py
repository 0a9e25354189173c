"""Holding a slot for its session's next turn, on a real llama-server without a RAM cache."""

from __future__ import annotations

from typing import Any

from tests.conftest import metric
from tests.integration.test_holds_fake import two_sessions


async def start(llama_servers: Any, proxy: Any, **over: Any) -> Any:
    server = llama_servers(slots=1, extra=("--cache-ram", "0"))  # nothing parked in RAM
    backends = [{"url": server.url, "ram_cache": False}]
    over.setdefault("disk", {"prefix_cache": "off", "park": "off"})  # holds alone
    return await proxy(
        backends, queue={"max_wait_seconds": 60}, timeouts={"read_seconds": 60}, **over
    )


async def test_a_session_keeps_its_slot_while_a_stranger_waits(
    llama_servers: Any, proxy: Any
) -> None:
    client = await start(llama_servers, proxy)
    size, reused, b_headers = await two_sessions(client, first_tokens=64)
    assert reused >= 0.9 * size, (reused, size)
    assert b_headers["X-Cache-Route"].startswith("wait")
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_slot_hold_waits_total") >= 1
    assert metric(page, "llama_cache_proxy_slot_hold_seconds") > 0


async def test_without_holds_the_stranger_overwrites_the_session(
    llama_servers: Any, proxy: Any
) -> None:
    client = await start(llama_servers, proxy, routing={"hold_max_seconds": 0})
    size, reused, _ = await two_sessions(client, first_tokens=64)
    assert reused < 0.5 * size, (reused, size)

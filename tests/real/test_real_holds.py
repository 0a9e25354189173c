"""Holding a slot for its session's next turn, on a real llama-server without a RAM cache."""

from __future__ import annotations

from typing import Any

from testbed.probes import metric
from tests.integration.test_holds_fake import two_sessions
from tests.integration.test_replicas import alternating

# The stranger waits through A's whole first turn, seconds of CPU prefill, and a held slot is
# kept from a request only while ``max_slot_wait_seconds`` lasts (5 s by default: the bound on
# any wait, a hold's included): on a slow machine A's first turn outlasted it and the stranger
# took the held slot. These tests are about the hold, not that bound.
PATIENT = {"max_slot_wait_seconds": 60}


async def start(llama_servers: Any, proxy: Any, **over: Any) -> Any:
    server = llama_servers(slots=1, extra=("--cache-ram", "0"))  # nothing parked in RAM
    backends = [{"url": server.url, "ram_cache": False}]
    over.setdefault("disk", {"prefix_cache": "off", "park": "off"})  # holds alone
    over["routing"] = {**PATIENT, **over.get("routing", {})}
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
    client = await start(llama_servers, proxy, routing={"max_slot_wait_seconds": 0})
    size, reused, _ = await two_sessions(client, first_tokens=64)
    assert reused < 0.5 * size, (reused, size)


async def test_two_replicas_hold_a_slot_for_a_session_whose_turns_alternate_them(
    llama_servers: Any, proxy: Any, redis_server: Any
) -> None:
    """Two proxies on one Redis, a session's turns alternating them (as behind the compose
    file's load balancer): the replica it comes back to holds its slot from a stranger."""
    server = llama_servers(slots=1, extra=("--cache-ram", "0"))
    backends = [{"url": server.url, "ram_cache": False}]
    over: dict[str, Any] = {
        "disk": {"prefix_cache": "off", "park": "off"},
        "queue": {"max_wait_seconds": 60},
        "timeouts": {"read_seconds": 60},
        "redis_url": redis_server.url,
        "routing": PATIENT,
    }
    a, b = await proxy(backends, **over), await proxy(backends, **over)
    size, reused, stranger_headers = await alternating(a, b)
    assert reused >= 0.9 * size, (reused, size)
    assert stranger_headers["X-Cache-Route"].startswith("wait")

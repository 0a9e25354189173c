"""A partial Redis outage, end to end: one replica loses Redis (its own network to it cut by
a relay) while another keeps it, in front of a fake llama-server that records every request
pinned to a busy slot."""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.shared_state import FENCE_MARGIN, HEARTBEAT_TTL
from tests.conftest import chat, metric
from tests.relay import Relay


async def test_a_replica_cut_off_from_redis_and_one_that_is_not_never_pin_one_slot(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """A loses Redis, B does not. A pins its part of the outage split with no lease, which B
    could not see: once A's heartbeat lapsed B took every slot it saw idle, A's running one
    too (1 of its 2 requests pinned A's busy slot). Now B keeps off A's part, and A starts
    claiming it only once B must have read the lapse. Both probe ``/slots`` rarely, so what
    keeps them apart is the store and the fence, not the polls."""
    relay = Relay(redis_server.url)
    backend = await fakes(n_slots=2, gen_s_per_token=0.03)
    rare = {"interval_seconds": 60}
    a = await proxy([backend], redis_url=await relay.start(), health=rare)
    b = await proxy([backend], redis_url=redis_server.url, health=rare)
    try:
        await asyncio.sleep(1.2)  # two heartbeats: each has read the other
        relay.cut()
        long = asyncio.create_task(
            a.post("/v1/chat/completions", json=chat("long", max_tokens=150))  # ~4.5 s
        )
        await asyncio.sleep(HEARTBEAT_TTL + FENCE_MARGIN + 1.0)  # A runs on its part by now
        assert not long.done()
        short = [
            b.post("/v1/chat/completions", json=chat(f"short {i}", max_tokens=10)) for i in range(2)
        ]
        statuses = [r.status for r in await asyncio.gather(*short)] + [(await long).status]
        assert statuses == [200] * 3
        page = await (await a.get("/metrics")).text()
        assert metric(page, "llama_cache_proxy_state_store_up") == 0  # A served without it
        assert backend.violations == []
    finally:
        await relay.close()

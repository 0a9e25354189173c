"""A partial Redis outage, end to end: one replica loses Redis (its own network to it cut by
a relay) while another keeps it, in front of a fake llama-server that records every request
pinned to a busy slot."""

from __future__ import annotations

import asyncio
from typing import Any

from testbed.probes import metric, until_listed
from tests.conftest import chat
from tests.relay import Relay
from tests.waiting import once_placed, until_metric


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
        await until_listed([str(c.make_url("")).rstrip("/") for c in (a, b)])
        relay.cut()
        await until_metric(a, "llama_cache_proxy_state_store_up", lambda n: n == 0)
        long_body = chat("long", max_tokens=150)  # ~4.5 s
        long = await once_placed(a.post("/v1/chat/completions", json=long_body), a)  # A's part
        await until_metric(b, "llama_cache_proxy_replicas_fenced", lambda n: n == 1)  # B read it
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

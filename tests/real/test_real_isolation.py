"""The timing probe across tenants, against a real llama-server (SmolLM2-135M, CPU).

A tenant probes whether another tenant sent a prompt by sending it and timing the answer:
a cached prefix answers many times faster. Without isolation the probe works; with
``isolation.mode: tenant`` it fails across tenants and still works within one.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.conftest import chat

SECRET = "Tenant A's confidential merger memo. " + " ".join(
    f"Clause {i}: the parties agree to item {i} of the schedule." for i in range(80)
)


async def timed(client: Any, key: str) -> tuple[float, int]:
    body = chat(SECRET, max_tokens=1, temperature=0)
    started = time.perf_counter()
    resp = await client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )
    assert resp.status == 200, await resp.text()
    seconds = time.perf_counter() - started
    return seconds, (await resp.json())["timings"]["cache_n"]


@pytest.mark.parametrize("mode", ["off", "tenant"])
async def test_timing_probe_across_tenants(llama_servers: Any, proxy: Any, mode: str) -> None:
    server = llama_servers(slots=1)
    client = await proxy(
        [server],
        isolation={"mode": mode},
        disk={"prefix_cache": "off"},
        timeouts={"read_seconds": 120},
    )
    cold, _ = await timed(client, "tenant-a")
    warm, warm_cached = await timed(client, "tenant-a")  # within a tenant: cached
    assert warm_cached > 800
    probe, probe_cached = await timed(client, "tenant-b")
    print(f"mode={mode}: A cold {cold:.3f}s, A again {warm:.3f}s, B probe {probe:.3f}s")
    if mode == "off":
        assert probe_cached > 800  # the probe sees A's prompt is cached ...
        assert probe < cold / 2  # ... and it shows in the timing
    else:
        assert probe_cached == 0  # computed from scratch
        assert probe > 2 * warm  # as slow as a cold prompt: the probe learns nothing

"""The timing probe across tenants, against a real llama-server (SmolLM2-135M, CPU).

A tenant probes whether another tenant sent a prompt by sending it and timing the answer:
a cached prefix answers many times faster. Without isolation the probe works; with
``isolation.mode: tenant`` it fails across tenants and still works within one.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import pytest

from tests.conftest import chat

SECRET = "Tenant A's confidential merger memo. " + " ".join(
    f"Clause {i}: the parties agree to item {i} of the schedule." for i in range(80)
)


async def timed(client: Any, key: str, header: str = "Authorization") -> tuple[float, int]:
    body = chat(SECRET, max_tokens=1, temperature=0)
    started = time.perf_counter()
    value = f"Bearer {key}" if header == "Authorization" else key
    resp = await client.post("/v1/chat/completions", json=body, headers={header: value})
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
        # a probe starved while the CPU prefills would hold the backend down until the next
        # one: this test times requests
        timeouts={"read_seconds": 120, "probe_seconds": 30},
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


async def test_keys_sent_in_x_api_key_are_tenants_too(llama_servers: Any, proxy: Any) -> None:
    """The Anthropic SDK sends its key in ``X-Api-Key``: each such key is its own tenant (not
    one anonymous tenant for all of them, who would then reuse each other's prompts)."""
    server = llama_servers(slots=1)
    client = await proxy(
        [server],
        api_key=["tenant-a", "tenant-b"],
        isolation={"mode": "tenant"},
        disk={"prefix_cache": "off"},
        timeouts={"read_seconds": 120, "probe_seconds": 30},
    )
    await timed(client, "tenant-a", "X-Api-Key")
    _, warm_cached = await timed(client, "tenant-a", "X-Api-Key")
    assert warm_cached > 800  # within a tenant: cached
    _, probe_cached = await timed(client, "tenant-b", "X-Api-Key")
    assert probe_cached == 0  # another key: computed from scratch


MEMO = "Tenant A's memo on the merger. " * 40  # within one batch of embeddings (512)
EMBEDDINGS = ("--embeddings", "--pooling", "mean")  # completions are served too


async def _cache_n(url: str, headers: dict[str, str]) -> int:
    """``cache_n`` of a completion of MEMO sent to ``url`` (the proxy or the server)."""
    body = {"prompt": MEMO, "n_predict": 1, "temperature": 0}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/completion", json=body, headers=headers) as resp,
    ):
        assert resp.status == 200, await resp.text()
        return int((await resp.json())["timings"]["cache_n"])


async def _embed(url: str, headers: dict[str, str]) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/embeddings", json={"input": MEMO}, headers=headers) as resp,
    ):
        assert resp.status == 200, await resp.text()
        assert len((await resp.json())["data"][0]["embedding"]) > 0


async def test_an_embedding_leaves_its_tokens_for_the_next_completion(
    llama_servers: Any,
) -> None:
    """The server side: an embedding is computed from scratch (stateless, ``cache_prompt``
    ignored), but its tokens stay in the slot, and a completion sharing them reuses them."""
    server = llama_servers(slots=1, extra=EMBEDDINGS)
    await _embed(server.url, {})
    assert await _cache_n(server.url, {}) > 250


async def test_embeddings_leave_nothing_another_tenant_reuses(
    llama_servers: Any, proxy: Any
) -> None:
    """Through the proxy under isolation: after tenant A's embedding the proxy does not know
    what the slot holds, so tenant B's completion is sent with ``cache_prompt: false``."""
    server = llama_servers(slots=1, extra=EMBEDDINGS)
    client = await proxy([server], isolation={"mode": "tenant"}, disk={"prefix_cache": "off"})
    tenant_a = {"Authorization": "Bearer tenant-a"}
    resp = await client.post("/v1/embeddings", json={"input": MEMO}, headers=tenant_a)
    assert resp.status == 200, await resp.text()
    body = {"prompt": MEMO, "n_predict": 1, "temperature": 0}
    cached = []
    for _ in range(2):
        resp = await client.post("/completion", json=body, headers={"Authorization": "Bearer b"})
        assert resp.status == 200, await resp.text()
        cached.append((await resp.json())["timings"]["cache_n"])
    assert cached[0] == 0  # nothing of A's reused
    assert cached[1] > 250  # within B: reused

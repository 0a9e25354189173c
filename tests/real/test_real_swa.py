"""Sliding-window backends for real (Gemma 3 270M, and SmolLM2 as the dense reference): the
reuse rule each backend applies is probed, predictions follow it, and the disk tier works
only where a restored slot is reused (``--swa-full``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.app import SCHEDULER
from proxy.core.server.fleet import BackendState
from testbed.probes import metric
from testbed.stack import LlamaServer
from tests.real.test_real_disk import disk, post, settle

SYSTEM = "You are the build agent of a small software team. Follow the rules below exactly. " + (
    " ".join(f"Rule {i}: keep change number {i} small and tested." for i in range(90))
)
AUTO = {"kv_reuse": "auto"}


def turn(session: int, *extra: dict[str, str]) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Session {session}: list three checks for release {session}."},
        *extra,
    ]
    return {"messages": messages, "max_tokens": 8, "temperature": 0}


def follow_up(session: int, reply: dict[str, Any]) -> dict[str, Any]:
    said = {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
    return turn(session, said, {"role": "user", "content": "And the fourth check?"})


async def start(proxy: Any, server: LlamaServer, **over: Any) -> tuple[Any, BackendState]:
    client = await proxy([{**AUTO, "url": server.url}], **over)
    backend: BackendState = client.server.app[SCHEDULER].fleet.backends[0]
    await probed(backend)
    return client, backend


async def probed(backend: BackendState) -> None:
    for _ in range(1200):  # a loaded CPU prefills the probe's 1,216 tokens in seconds
        if backend.reuse_known:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the reuse rule was never probed")


@pytest.mark.parametrize("swa_full", [False, True], ids=["swa", "swa-full"])
async def test_gemma_rule_is_probed(gemma_servers: Any, proxy: Any, swa_full: bool) -> None:
    _, backend = await start(proxy, gemma_servers(swa_full=swa_full))
    assert backend.exact is not swa_full


async def test_smollm2_is_probed_dense(llama_servers: Any, proxy: Any) -> None:
    _, backend = await start(proxy, llama_servers(slots=2))
    assert not backend.exact


async def test_gemma_predictions_match_the_reuse_through_checkpoints(
    gemma_servers: Any, proxy: Any
) -> None:
    """One slot: A, A's next turn, B (same system prompt), A again. Without --swa-full a
    slot is reused only as an exact extension or from the checkpoint at its last
    user-message start; every returning turn is predicted within 10 %. (A one-slot backend
    is not probed: its rule is configured, as the tests above probe it.)"""
    client = await proxy([{"url": gemma_servers(slots=1).url, "kv_reuse": "exact"}])
    backend: BackendState = client.server.app[SCHEDULER].fleet.backends[0]
    assert backend.exact
    first, _ = await post(client, turn(0))
    seen = []
    for body in (follow_up(0, first), turn(1), follow_up(0, first)):
        answer, headers = await post(client, body)
        seen.append((int(headers["X-Cache-Predicted-Tokens"]), answer["timings"]["cache_n"]))
    for predicted, cached in seen:
        assert cached > 500
        assert abs(predicted - cached) <= 0.1 * cached, seen


async def test_gemma_without_swa_full_saves_nothing_to_disk(gemma_servers: Any, proxy: Any) -> None:
    server = gemma_servers()
    client, backend = await start(proxy, server, disk=disk(server, prefix_cache="full"))
    assert backend.exact
    for session in range(2):
        await post(client, turn(session))
    assert list(server.save_dir.glob("llp-*")) == []
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_disk_saves_total", kind="full") == 0


async def test_gemma_with_swa_full_reuses_a_restore_after_a_restart(
    gemma_servers: Any, proxy: Any
) -> None:
    server = gemma_servers(swa_full=True)
    over = {"disk": disk(server, prefix_cache="full"), "health": {"interval_seconds": 0.2}}
    client, backend = await start(proxy, server, **over)
    assert not backend.exact
    first, _ = await post(client, turn(0))
    assert list(server.save_dir.glob("llp-*"))
    await settle(client, server)  # every slot is empty; the file is on disk
    await probed(backend)
    answer, headers = await post(client, follow_up(0, first))
    assert headers["X-Cache-Route"] == "disk"
    assert answer["timings"]["cache_n"] >= 0.9 * first["usage"]["prompt_tokens"]

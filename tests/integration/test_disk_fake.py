"""The disk tier against fake llama-servers that save and restore slots like the real one."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from proxy.app import HANDLERS, PROBER
from proxy.core.disk.snapshots import Lookup
from proxy.disk.tier import DiskTier
from proxy.upstream import LlamaServerClient, SlotActionFailed
from testbed.fake_llama import FakeLlamaServer
from testbed.probes import metric
from tests.waiting import scrape, until, until_down, until_metric

SYSTEM = "You are a careful coding agent. " + " ".join(f"rule{i} applies." for i in range(150))


def turn(session: int, n: int, **extra: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for i in range(n):
        messages.append({"role": "user", "content": f"session {session} question {i}"})
        if i < n - 1:
            messages.append({"role": "assistant", "content": f"answer {i} for {session}"})
    return {"messages": messages, "max_tokens": 4, **extra}


MODEL_INFO = "llama_cache_proxy_backend_model_info"


def disk(tmp: Path, **over: Any) -> dict[str, Any]:
    return {"slot_save_dir": str(tmp), "min_tokens": 64, **over}


def snapshot_files(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("llp-*.bin")}


async def restart(fakes: Any, fake: FakeLlamaServer, client: Any, **kwargs: Any) -> FakeLlamaServer:
    """``fake`` stopped and started again on its port, once the proxy behind ``client`` has
    seen it go (a restart between two probes of an idle backend can pass unseen) and come
    back (its slot state invalidated)."""
    restarts = "llama_cache_proxy_backend_restarts_total"
    before = await scrape(client, restarts)
    await fake.stop()
    await until_down(client, fake)
    fresh: FakeLlamaServer = await fakes(port=fake.port, **kwargs)
    await until_metric(client, restarts, lambda n: n > before)
    return fresh


async def test_auto_scope_saves_the_shared_prefix_once_and_restores_it_after_restart(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    fake = await fakes(n_slots=2, save_dir=tmp_path)
    client = await proxy([fake], disk=disk(tmp_path), health={"interval_seconds": 0.05})
    first = await client.post("/v1/chat/completions", json=turn(0, 1))
    assert first.status == 200
    assert fake.slot_actions == []  # an empty window selects nothing yet
    before = fake.tokens_processed
    second = await client.post("/v1/chat/completions", json=turn(1, 1))
    assert second.status == 200
    assert [a[0] for a in fake.slot_actions] == ["save", "restore"]
    assert fake.slot_actions[0][2].startswith("llp-")
    # the first session's slot held the system prompt: saved, restored into the second's
    # slot (no warm-up prefilled it again), which computed only its own part
    assert not [b for path, b, _ in fake.received if path == "/completion"]
    usage = (await second.json())["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 300
    assert fake.tokens_processed - before == usage["prompt_tokens"] - cached
    # and the hit rate counts the tokens the warm-up computed as computed, not as cached
    text = await (await client.get("/metrics")).text()
    cached = metric(text, "llama_cache_proxy_cached_tokens_total")
    assert metric(text, "llama_cache_proxy_prompt_tokens_total") - cached == fake.tokens_processed
    # and the prediction (an empty slot, before the warm-up filled it) is not counted against it
    assert metric(text, "llama_cache_proxy_route_predictions_total", outcome="under") == 0

    fake = await restart(fakes, fake, client, n_slots=2, save_dir=tmp_path)
    third = await client.post("/v1/chat/completions", json=turn(2, 1))
    assert third.status == 200
    assert third.headers["X-Cache-Route"] == "disk"
    assert [a[0] for a in fake.slot_actions] == ["restore"]
    cached = (await third.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert fake.tokens_restored >= cached > 300  # the whole system prompt came from disk
    text = await (await client.get("/metrics")).text()
    # the copy into the second session's slot, and this one, served what they should
    assert metric(text, "llama_cache_proxy_disk_events_total", event="hit") == 2
    assert metric(text, "llama_cache_proxy_disk_saves_total", kind="scoped") == 1


async def test_off_is_final_a_client_only_narrows_and_full_saves_after_each_request(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    fake = await fakes(n_slots=2, save_dir=tmp_path)
    client = await proxy([fake], disk=disk(tmp_path, prefix_cache="off"))
    for session in range(3):
        assert (await client.post("/v1/chat/completions", json=turn(session, 1))).status == 200
    for session, scope in enumerate(("full", "auto:1", "100", "auto")):
        wider = turn(session, 2, prefix_cache={"scope": scope})  # a client cannot widen off
        assert (await client.post("/v1/chat/completions", json=wider)).status == 200
        assert "prefix_cache" not in fake.received[-1][1]  # stripped
    assert fake.slot_actions == []
    assert not [b for path, b, _ in fake.received if path == "/completion"]  # no warm-up

    fake = await fakes(n_slots=2, save_dir=tmp_path)
    client = await proxy([fake], disk=disk(tmp_path, prefix_cache="full"))
    narrower = turn(5, 2, prefix_cache={"scope": "off"})
    assert (await client.post("/v1/chat/completions", json=narrower)).status == 200
    assert fake.slot_actions == []
    assert (await client.post("/v1/chat/completions", json=turn(6, 2))).status == 200
    assert [a[0] for a in fake.slot_actions] == ["save"]


async def test_fixed_scope_aligns_down_to_a_message_boundary(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    fake = await fakes(n_slots=1, save_dir=tmp_path)
    client = await proxy([fake], disk=disk(tmp_path, prefix_cache="full"))
    body = turn(0, 2, prefix_cache={"scope": "1500"})
    body["messages"][-1]["content"] = " ".join(f"word{i}" for i in range(2000))
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    warm = [b for path, b, _ in fake.received if path == "/completion"]
    assert len(warm) == 1
    assert warm[0]["n_predict"] == 0
    words = {v: k for k, v in fake._vocab.items()}
    text = "".join(words[t] for t in warm[0]["prompt"])
    assert 300 < len(warm[0]["prompt"]) <= 1500
    assert text.endswith("answer 0 for 0<|im_end|>\n")  # cut after a whole message
    assert [a[0] for a in fake.slot_actions] == ["save"]


async def test_snapshot_from_another_layout_is_refused(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    two = await fakes(n_slots=2, save_dir=tmp_path)
    three = await fakes(n_slots=3, save_dir=tmp_path)
    client = await proxy([two, three], disk=disk(tmp_path, prefix_cache="full"))
    scoped = {"prefix_cache": {"scope": "1000"}}
    assert (await client.post("/v1/chat/completions", json=turn(0, 1, **scoped))).status == 200
    saved_on = two if two.slot_actions else three
    other = three if saved_on is two else two
    await saved_on.stop()  # only the other layout is left
    await until_down(client, saved_on)
    resp = await client.post("/v1/chat/completions", json=turn(0, 2, **scoped))
    assert resp.status == 200
    assert not [a for a in other.slot_actions if a[0] == "restore"]
    text = await (await client.get("/metrics")).text()
    assert metric(text, "llama_cache_proxy_disk_refusals_total", reason="layout") >= 1


async def test_backend_without_save_path_turns_the_disk_tier_off_for_it(
    fakes: Any, proxy: Any
) -> None:
    fake = await fakes(n_slots=1)  # no save directory: 501 like the real server
    client = await proxy([fake], disk={"min_tokens": 64, "prefix_cache": "full"})
    for _ in range(3):
        assert (await client.post("/v1/chat/completions", json=turn(0, 1))).status == 200
    assert len(fake.slot_actions) == 0
    assert sum(1 for path, _, _ in fake.received if path == "/completion") == 0


async def test_park_before_evict_brings_a_session_back_from_disk(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    fake = await fakes(n_slots=1, save_dir=tmp_path, ram_cache=False)
    backends = [{"url": fake.url, "ram_cache": False}]  # the session has no RAM copy
    client = await proxy(backends, disk=disk(tmp_path, park_min_tokens=200))
    a1 = turn(0, 1)
    reply = await (await client.post("/v1/chat/completions", json=a1)).json()
    stranger = {"messages": [{"role": "user", "content": "unrelated " * 50}], "max_tokens": 4}
    assert (await client.post("/v1/chat/completions", json=stranger)).status == 200
    assert [a[0] for a in fake.slot_actions] == ["save"]  # session A parked first
    a2 = {
        **a1,
        "messages": [
            *a1["messages"],
            reply["choices"][0]["message"],
            {"role": "user", "content": "and then?"},
        ],
    }
    back = await client.post("/v1/chat/completions", json=a2)
    # the stranger's slot is held for it a moment (core.returns) before A's restore
    assert back.headers["X-Cache-Route"] in ("disk", "wait+disk")
    assert [a[0] for a in fake.slot_actions] == ["save", "restore"]
    cached = (await back.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= reply["usage"]["prompt_tokens"] - 1  # all of A's previous prompt
    text = await (await client.get("/metrics")).text()
    assert metric(text, "llama_cache_proxy_disk_saves_total", kind="park") == 1


async def test_a_session_back_while_its_slot_is_being_parked_waits_and_restores_it(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    """Another request takes the session's only slot as its turn ends and parks what it
    held; the session's next turn arrives while that save is being written. It waits for the
    park and restores it. Before, its snapshot lookup ran first, found nothing, and the turn
    re-prefilled its whole history once the slot was free."""
    fake = await fakes(n_slots=1, save_dir=tmp_path, ram_cache=False)
    fake.save_s = 0.3
    backends = [{"url": fake.url, "ram_cache": False}]
    client = await proxy(backends, disk=disk(tmp_path, park_min_tokens=200))
    a1 = turn(0, 1)
    reply = await (await client.post("/v1/chat/completions", json=a1)).json()
    stranger = {"messages": [{"role": "user", "content": "unrelated " * 50}], "max_tokens": 4}
    taking = asyncio.create_task(client.post("/v1/chat/completions", json=stranger))
    await until(lambda: bool(fake.slot_actions), "the park starts", every=0.005)
    assert [a[0] for a in fake.slot_actions] == ["save"]
    a2 = {
        **a1,
        "messages": [
            *a1["messages"],
            reply["choices"][0]["message"],
            {"role": "user", "content": "and then?"},
        ],
    }
    back = await client.post("/v1/chat/completions", json=a2)
    assert (await taking).status == 200
    assert back.headers["X-Cache-Route"] in ("disk", "wait+disk")
    assert [a[0] for a in fake.slot_actions] == ["save", "restore"]
    cached = (await back.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= reply["usage"]["prompt_tokens"] - 1  # all of A's previous prompt


async def test_a_restore_that_is_not_reused_marks_the_snapshot_bad(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    fake = await fakes(n_slots=1, save_dir=tmp_path)
    client = await proxy(
        [fake],
        disk=disk(tmp_path, prefix_cache="full"),
        admin_token="t",
        health={"interval_seconds": 0.05},
    )
    scoped = {"prefix_cache": {"scope": "1000"}}
    assert (await client.post("/v1/chat/completions", json=turn(0, 1, **scoped))).status == 200
    (name,) = [a[2] for a in fake.slot_actions]
    (tmp_path / name).write_text(
        json.dumps({"layout": {"n_stream": 1, "n_ctx": 8192}, "tokens": ["x"] * 400})
    )
    fake = await restart(fakes, fake, client, n_slots=1, save_dir=tmp_path)
    resp = await client.post("/v1/chat/completions", json=turn(0, 2, **scoped))
    assert resp.status == 200
    assert resp.headers["X-Cache-Route"] == "disk"  # restored the (tampered) file ...
    text = await (await client.get("/metrics")).text()
    assert metric(text, "llama_cache_proxy_disk_events_total", event="bad") == 1  # ... not reused
    status = await (await client.get("/admin/disk", headers={"Authorization": "Bearer t"})).json()
    assert status["index"]["bad"] == 1
    again = await client.post("/v1/chat/completions", json=turn(0, 2, **scoped))
    assert again.headers["X-Cache-Route"] != "disk"  # a bad snapshot is never offered again


async def test_budget_evicts_least_recently_used_files_it_can_see(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    fake = await fakes(n_slots=1, save_dir=tmp_path)
    full = {"prefix_cache": {"scope": "full"}}
    client = await proxy([fake], disk=disk(tmp_path, prefix_cache="full", max_bytes=9000))
    for session in range(4):  # each full snapshot is ~4 KB in the fake
        assert (await client.post("/v1/chat/completions", json=turn(session, 1, **full))).status
    names = [a[2] for a in fake.slot_actions]
    assert len(names) == 4
    on_disk = snapshot_files(tmp_path)
    assert on_disk == set(names[-2:])  # the two oldest were deleted
    text = await (await client.get("/metrics")).text()
    assert metric(text, "llama_cache_proxy_disk_events_total", event="eviction") == 2
    assert metric(text, "llama_cache_proxy_disk_index_entries") == 2


async def test_without_a_shared_path_evictions_only_forget_entries(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    fake = await fakes(n_slots=1, save_dir=tmp_path)
    full = {"prefix_cache": {"scope": "full"}}
    settings = {"prefix_cache": "full", "min_tokens": 64, "max_bytes": 9000}
    client = await proxy([fake], disk=settings)  # the proxy does not see the directory
    for session in range(4):
        assert (await client.post("/v1/chat/completions", json=turn(session, 1, **full))).status
    assert len(snapshot_files(tmp_path)) == 4  # files stay where the server wrote them
    text = await (await client.get("/metrics")).text()
    assert metric(text, "llama_cache_proxy_disk_index_entries") == 2


async def test_replicas_share_the_snapshot_index(
    fakes: Any, proxy: Any, tmp_path: Path, redis_server: Any
) -> None:
    fake = await fakes(n_slots=2, save_dir=tmp_path)
    settings = {"disk": disk(tmp_path), "redis_url": redis_server.url}
    a = await proxy([fake], health={"interval_seconds": 0.05}, **settings)
    b = await proxy([fake], health={"interval_seconds": 0.05}, **settings)
    assert (await a.post("/v1/chat/completions", json=turn(0, 1))).status == 200
    assert (await b.post("/v1/chat/completions", json=turn(1, 1))).status == 200  # window in Redis
    assert [x[0] for x in fake.slot_actions] == ["save", "restore"]  # a's slot copied
    fake = await restart(fakes, fake, a, n_slots=2, save_dir=tmp_path)
    resp = await a.post("/v1/chat/completions", json=turn(2, 1))
    assert resp.headers["X-Cache-Route"] == "disk"  # saved through b, restored through a


async def test_park_auto_leaves_sessions_to_the_servers_ram_cache(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    for park, parked in (("auto", 0), ("on", 1)):
        fake = await fakes(n_slots=1, save_dir=tmp_path)  # RAM cache on
        client = await proxy([fake], disk=disk(tmp_path, park_min_tokens=200, park=park))
        await client.post("/v1/chat/completions", json=turn(0, 1))
        stranger = {"messages": [{"role": "user", "content": "unrelated " * 50}], "max_tokens": 4}
        await client.post("/v1/chat/completions", json=stranger)
        text = await (await client.get("/metrics")).text()
        assert metric(text, "llama_cache_proxy_disk_saves_total", kind="park") == parked


async def test_park_auto_saves_a_session_whose_slot_keeps_only_the_shared_system_prompt(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    """RAM cache on, and another session sharing the system prompt takes the only slot: it
    keeps more than half of the slot, so the server neither saves the session in RAM nor
    loads it back. Parked on disk first, the session's next turn restores its own turn."""
    fake = await fakes(n_slots=1, save_dir=tmp_path)  # RAM cache on
    client = await proxy([fake], disk=disk(tmp_path, park_min_tokens=200))
    a1 = turn(0, 1)
    reply = await (await client.post("/v1/chat/completions", json=a1)).json()
    assert (await client.post("/v1/chat/completions", json=turn(1, 1))).status == 200
    text = await (await client.get("/metrics")).text()
    assert metric(text, "llama_cache_proxy_disk_saves_total", kind="park") == 1
    messages = [*a1["messages"], reply["choices"][0]["message"], {"role": "user", "content": "?"}]
    back = await client.post("/v1/chat/completions", json={**a1, "messages": messages})
    assert back.headers["X-Cache-Route"] in ("disk", "wait+disk")
    assert [a[0] for a in fake.slot_actions][-1] == "restore"
    cached = (await back.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= reply["usage"]["prompt_tokens"] - 1  # its previous prompt, not the header


@pytest.mark.parametrize("budget", [None, 100_000])
async def test_park_auto_leaves_a_session_with_a_ram_copy_to_a_primer(
    fakes: Any, proxy: Any, tmp_path: Path, budget: int | None
) -> None:
    """As above, but the session's slot was saved to RAM while idle (a task started on the
    other slot) before another session sharing the system prompt took it: no file is written,
    and the session's next turn comes back from RAM through a primer. Under a RAM budget the
    copy may be pushed out before the session is back: it is parked on disk all the same."""
    fake = await fakes(n_slots=2, save_dir=tmp_path, ram_tokens=budget)  # RAM cache on
    backend = {"url": fake.url, "ram_cache_tokens": budget}
    client = await proxy([backend], disk=disk(tmp_path, park_min_tokens=200))
    a1 = turn(0, 1)
    reply = await (await client.post("/v1/chat/completions", json=a1)).json()
    for session in (1, 2):  # the first starts on the other slot: slot 0 is saved to RAM
        assert (await client.post("/v1/chat/completions", json=turn(session, 1))).status == 200
    messages = [*a1["messages"], reply["choices"][0]["message"], {"role": "user", "content": "?"}]
    back = await client.post("/v1/chat/completions", json={**a1, "messages": messages})
    cached = (await back.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= reply["usage"]["prompt_tokens"] - 1  # its previous prompt, not the header
    text = await (await client.get("/metrics")).text()
    parks = metric(text, "llama_cache_proxy_disk_saves_total", kind="park")
    assert (parks == 0) is (budget is None)
    if budget is None:
        assert metric(text, "llama_cache_proxy_ram_primers_total", outcome="sent") >= 1


async def test_park_on_saves_a_primed_slots_content_before_the_primer(
    fakes: Any, proxy: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    """``park: on`` parks even what the server keeps in RAM: for a primed slot the park comes
    before the primer, which replaces the slot's content (parked after it, the file would
    hold the primer). No snapshot is offered here, so the returning session is primed."""

    async def nothing(self: Any, fp: Any, tenant: Any = None) -> Lookup:
        return Lookup({}, 0)

    monkeypatch.setattr(DiskTier, "lookup", nothing)
    fake = await fakes(n_slots=2, save_dir=tmp_path)
    client = await proxy([fake], disk=disk(tmp_path, park_min_tokens=200, park="on"))
    a1 = turn(0, 1)
    reply = await (await client.post("/v1/chat/completions", json=a1)).json()
    for session in (1, 2):
        assert (await client.post("/v1/chat/completions", json=turn(session, 1))).status == 200
    messages = [*a1["messages"], reply["choices"][0]["message"], {"role": "user", "content": "?"}]
    back = await client.post("/v1/chat/completions", json={**a1, "messages": messages})
    assert back.status == 200
    text = await (await client.get("/metrics")).text()
    assert metric(text, "llama_cache_proxy_ram_primers_total", outcome="sent") >= 1
    assert metric(text, "llama_cache_proxy_disk_saves_total", kind="park") >= 1
    assert "not kept" not in caplog.text


async def test_sessions_arriving_together_save_their_shared_prefix_once_and_restore_it(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    """New sessions with one system prompt, sent together to a 4-slot backend: one of them
    saves the prefix the window selects (copied from the first session's slot, which holds
    it); the others, about to do the same for the same prefix, wait for that save and
    restore it into their own slots instead."""
    fake = await fakes(n_slots=4, save_dir=tmp_path, prompt_s_per_token=0.001)
    client = await proxy([fake], disk=disk(tmp_path), queue={"max_wait_seconds": 30})
    first = await client.post("/v1/chat/completions", json=turn(0, 1))  # the window learns
    assert first.status == 200
    answers = await asyncio.gather(
        *(client.post("/v1/chat/completions", json=turn(s, 1)) for s in range(1, 4))
    )
    assert [a.status for a in answers] == [200, 200, 200]
    actions = [a[0] for a in fake.slot_actions]
    assert actions.count("save") == 1
    assert actions.count("restore") >= 1
    warm = [b for path, b, _ in fake.received if path == "/completion"]
    assert warm == []  # the prefix was never prefilled again


OTHER = "You are a poet. " + " ".join(f"verse{i} rhymes." for i in range(150))


def stranger(n: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": OTHER}, {"role": "user", "content": f"poem {n}"}]
    return {"messages": messages, "max_tokens": 4}


async def test_a_snapshot_is_only_restored_for_the_lora_adapters_it_was_computed_under(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    """llama-server computes a slot's KV under the request's adapters (``lora``); a
    restored file keeps the KV it holds. The warm-up of a scoped save runs under the
    request's adapters, and a request asking for other adapters is not offered the file."""
    fake = await fakes(n_slots=1, save_dir=tmp_path, prompt_s_per_token=0.0005, ram_cache=False)
    client = await proxy(
        [{"url": fake.url, "ram_cache": False, "kv_reuse": "prefix"}],
        disk=disk(tmp_path),
        health={"interval_seconds": 60},
    )
    adapter_on = {"lora": [{"id": 0, "scale": 1.0}]}
    for s in (0, 1):  # the second saves the system prompt (scoped)
        resp = await client.post("/v1/chat/completions", json=turn(s, 1, **adapter_on))
        assert resp.status == 200
    assert [a[0] for a in fake.slot_actions] == ["save"]
    warm = [body for path, body, _ in fake.received if path == "/completion"]
    assert [body.get("lora") for body in warm] == [adapter_on["lora"]]
    assert (await client.post("/v1/chat/completions", json=stranger(0))).status == 200
    adapter_off = {"lora": [{"id": 0, "scale": 0.0}]}
    resp = await client.post("/v1/chat/completions", json=turn(2, 1, **adapter_off))
    assert resp.status == 200
    assert "restore" not in [a[0] for a in fake.slot_actions]
    resp = await client.post("/v1/chat/completions", json=turn(3, 1, **adapter_on))
    assert resp.status == 200
    assert [a[0] for a in fake.slot_actions][-1] == "restore"  # the same adapters: restored


async def test_a_save_of_a_slot_the_server_had_emptied_is_not_kept(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    """The server lost a slot's content unseen (a restart between probes, a purge): parking
    it saves a file of no token. Kept, every later turn of that session restored nothing
    and counted a hit; now it is not listed, and nothing is restored."""
    fake = await fakes(n_slots=1, save_dir=tmp_path, ram_cache=False, prompt_s_per_token=0.0005)
    client = await proxy(
        [{"url": fake.url, "ram_cache": False, "kv_reuse": "prefix"}],
        disk=disk(tmp_path, prefix_cache="1", park="on", park_min_tokens=64),
        health={"interval_seconds": 60},
    )
    assert (await client.post("/v1/chat/completions", json=turn(7, 1))).status == 200
    fake.slots[0].tokens = []  # lost, unseen
    assert (await client.post("/v1/chat/completions", json=stranger(0))).status == 200
    assert [a[0] for a in fake.slot_actions] == ["save"]  # the park
    resp = await client.post("/v1/chat/completions", json=turn(7, 2))
    assert resp.status == 200
    assert "restore" not in [a[0] for a in fake.slot_actions]
    text = await (await client.get("/metrics")).text()
    assert metric(text, "llama_cache_proxy_disk_events_total", event="hit") == 0


async def test_a_failed_props_read_is_tried_again_by_the_next_request(
    fakes: Any, proxy: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """One failed read of a backend's layout left its disk tier off until it restarted."""
    real, calls = LlamaServerClient.props, [0]

    async def blip(self: LlamaServerClient, base_url: str) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise SlotActionFailed("/props: TimeoutError")
        return await real(self, base_url)

    monkeypatch.setattr(LlamaServerClient, "props", blip)
    fake = await fakes(n_slots=2, save_dir=tmp_path)
    client = await proxy([fake], disk=disk(tmp_path), health={"interval_seconds": 60})
    for s in range(4):
        assert (await client.post("/v1/chat/completions", json=turn(s, 1))).status == 200
    assert calls[0] == 2
    assert "save" in [a[0] for a in fake.slot_actions]


@pytest.mark.parametrize("change", [{"model": "beta"}, {"n_ctx": 4096}], ids=["model", "ctx"])
async def test_a_restart_with_another_model_between_two_probes_is_a_restart(
    fakes: Any, proxy: Any, tmp_path: Path, change: dict[str, Any]
) -> None:
    """Restarted on its port with another model (or context) between two probes of an idle
    backend, the server shows it only in ``/props``: that is a restart. No snapshot of the old
    model is restored into the new one (the real server loads one of the same shape silently:
    wrong output), none of another context is offered and marked bad for every backend, and
    the model info names the new model alone."""
    fake = await fakes(n_slots=2, save_dir=tmp_path, model="alpha", ram_cache=False)
    backend = {"url": fake.url, "ram_cache": False}
    client = await proxy([backend], disk=disk(tmp_path), probe_loop=False)
    prober = client.server.app[PROBER]
    for session in (0, 1):
        assert (await client.post("/v1/chat/completions", json=turn(session, 1))).status == 200
    for n in range(2):  # the system prompt now on disk only
        text = " ".join(f"filler{n}_{i}" for i in range(400))
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
    await prober.probe_all()
    await prober.probe_all()  # an idle backend: /health and /props only
    await fake.stop()
    settings = {"n_slots": 2, "save_dir": tmp_path, "model": "alpha", "ram_cache": False}
    fresh = await fakes(port=fake.port, **{**settings, **change})
    await prober.probe_all()
    resp = await client.post("/v1/chat/completions", json=turn(7, 1))
    assert resp.status == 200
    assert [a for a in fresh.slot_actions if a[0] == "restore"] == []
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_backend_restarts_total") == 1
    models = [line for line in page.splitlines() if line.startswith(MODEL_INFO + "{")]
    assert len(models) == 1
    assert f'model="{change.get("model", "alpha")}.gguf"' in models[0]
    index = await client.server.app[HANDLERS]._disk.index.all()
    assert index
    assert not any(e.bad for e in index)

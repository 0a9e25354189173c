"""Cache isolation against the fake: one tenant never reuses another tenant's prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.conftest import chat
from tests.integration.test_disk_fake import SYSTEM, disk, stranger

PROMPT = "confidential plan of tenant A: " + "step " * 300


def as_tenant(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_prompt_cached_for_one_tenant_is_computed_again_for_another(
    fakes: Any, proxy: Any
) -> None:
    fake = await fakes(n_slots=1)  # one slot: the second tenant must land on A's KV
    client = await proxy([fake], isolation={"mode": "tenant"}, disk={"prefix_cache": "off"})
    body = chat(PROMPT, max_tokens=4)
    first = await client.post("/v1/chat/completions", json=body, headers=as_tenant("a"))
    assert first.status == 200
    probe = await client.post("/v1/chat/completions", json=body, headers=as_tenant("b"))
    assert (await probe.json())["timings"]["cache_n"] == 0  # the probe learns nothing
    assert fake.received[-1][1]["cache_prompt"] is False
    assert probe.headers["X-Cache-Predicted-Tokens"] == "0"
    again = await client.post("/v1/chat/completions", json=body, headers=as_tenant("b"))
    assert (await again.json())["timings"]["cache_n"] > 300  # within a tenant: reused
    back = await client.post("/v1/chat/completions", json=body, headers=as_tenant("a"))
    assert (await back.json())["timings"]["cache_n"] == 0  # B's KV now: A starts over


async def test_without_isolation_the_probe_would_work(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=1)
    client = await proxy([fake], disk={"prefix_cache": "off"})
    body = chat(PROMPT, max_tokens=4)
    await client.post("/v1/chat/completions", json=body, headers=as_tenant("a"))
    probe = await client.post("/v1/chat/completions", json=body, headers=as_tenant("b"))
    assert (await probe.json())["timings"]["cache_n"] > 300


async def test_messages_endpoint_is_served_pinned_under_isolation(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=1)
    client = await proxy([fake], isolation={"mode": "tenant"}, disk={"prefix_cache": "off"})
    body = {**chat(PROMPT), "max_tokens": 4}
    first = await client.post("/v1/messages", json=body, headers=as_tenant("a"))
    assert first.status == 200
    assert (await first.json())["type"] == "message"
    path, sent, _ = fake.received[-1]
    assert path == "/v1/chat/completions"
    assert (sent["id_slot"], sent["cache_prompt"]) == (0, False)  # an empty slot: no reuse
    again = await client.post("/v1/messages", json=body, headers=as_tenant("a"))
    assert fake.received[-1][1]["cache_prompt"] is True  # the tenant's own KV
    assert (await again.json())["usage"]["cache_read_input_tokens"] > 300
    other = await client.post("/v1/messages", json=body, headers=as_tenant("b"))
    assert fake.received[-1][1]["cache_prompt"] is False
    assert (await other.json())["usage"]["cache_read_input_tokens"] == 0


async def test_tenants_do_not_share_disk_snapshots_or_affinities(
    fakes: Any, proxy: Any, tmp_path: Any
) -> None:
    fake = await fakes(n_slots=2, save_dir=tmp_path)
    disk = {"slot_save_dir": str(tmp_path), "min_tokens": 64, "prefix_cache": "full"}
    client = await proxy([fake], isolation={"mode": "tenant"}, disk=disk)
    scoped = {"prefix_cache": {"scope": "full"}, "prompt_cache_key": "shared-key"}
    body = chat(PROMPT, max_tokens=4, **scoped)
    await client.post("/v1/chat/completions", json=body, headers=as_tenant("a"))
    assert [a[0] for a in fake.slot_actions] == ["save"]
    for slot in fake.slots:
        slot.tokens = []  # as after a restart: only the disk holds A's prompt
    probe = await client.post("/v1/chat/completions", json=body, headers=as_tenant("b"))
    assert probe.headers["X-Cache-Route"] != "disk"
    assert "restore" not in [a[0] for a in fake.slot_actions]
    assert (await probe.json())["timings"]["cache_n"] == 0


async def test_an_empty_slot_gets_no_reuse_should_the_server_load_its_ram_cache_there(
    fakes: Any, proxy: Any
) -> None:
    """A pinned empty slot skips llama-server's RAM cache only through a bug (upstream
    #28139); on a server without it, another tenant's parked prompt would load there."""
    fake = await fakes(n_slots=3, empty_pin_loads_ram=True)
    client = await proxy([fake], isolation={"mode": "tenant"}, disk={"prefix_cache": "off"})
    body = chat(PROMPT, max_tokens=4)
    await client.post("/v1/chat/completions", json=body, headers=as_tenant("a"))
    await client.post("/v1/chat/completions", json=chat("hello"), headers=as_tenant("c"))
    assert any(len(entry) > 300 for entry in fake.ram)  # A's prompt parked in the RAM cache
    probe = await client.post("/v1/chat/completions", json=body, headers=as_tenant("b"))
    assert fake.received[-1][1]["cache_prompt"] is False
    assert (await probe.json())["timings"]["cache_n"] == 0


async def test_a_tenant_is_not_restored_a_file_it_keeps_little_of(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    """A's long session is parked to disk. B's secret, evicted by C, sits in the server's
    RAM cache. A's guess of B's prompt shares A's file only up to its first user message:
    restored, the slot would keep too little of it, the server would consult its RAM cache
    and serve B's secret. Under isolation such a file is not offered."""
    fake = await fakes(n_slots=1, save_dir=tmp_path, prompt_s_per_token=0.0005, ram_tokens=1200)
    client = await proxy(
        [{"url": fake.url, "kv_reuse": "prefix", "ram_cache_tokens": 1200}],
        isolation={"mode": "tenant"},
        health={"interval_seconds": 60},
        disk=disk(tmp_path, prefix_cache="1", park="on", park_min_tokens=64),
    )
    system = {"role": "system", "content": SYSTEM}
    audit = {"role": "user", "content": "audit the repository"}
    secret = {"role": "user", "content": "secret merger plan " + "detail " * 150}
    tool = {"role": "user", "content": "tool output " + "line " * 1500}

    def body(*messages: dict[str, Any]) -> dict[str, Any]:
        return {"messages": [system, *messages], "max_tokens": 4}

    reply = {"role": "assistant", "content": "ok"}
    for sent, tenant in [
        (body(audit), "A"),
        (body(audit, reply, tool), "A"),
        (body(audit, secret), "B"),  # (A's session parked as B takes the slot)
        (stranger(0), "C"),  # (B's secret into the server's RAM cache)
    ]:
        assert (
            await client.post("/v1/chat/completions", json=sent, headers=as_tenant(tenant))
        ).status == 200
    guess = await client.post(
        "/v1/chat/completions", json=body(audit, secret), headers=as_tenant("A")
    )
    assert guess.status == 200
    assert "restore" not in [action[0] for action in fake.slot_actions]
    assert (await guess.json())["usage"]["prompt_tokens_details"]["cached_tokens"] < 100

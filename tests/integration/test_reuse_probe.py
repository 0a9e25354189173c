"""Each backend's reuse rule probed at start-up against fakes with dense, sliding-window and
recurrent memory (``kv_reuse: auto``), and the disk tier left off where it cannot help."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from proxy.app import SCHEDULER
from proxy.core.server.fleet import BackendState
from testbed.fake_llama import FakeLlamaServer
from testbed.fake_memory import RECURRENT, SWA, Memory
from tests.integration.test_disk_fake import disk, turn
from tests.waiting import until

AUTO = {"url": "", "kv_reuse": "auto"}


async def probed(client: Any, index: int = 0) -> BackendState:
    backend: BackendState = client.server.app[SCHEDULER].fleet.backends[index]
    await until(lambda: backend.reuse_known, "the backend's reuse rule is probed")
    return backend


def probes(fake: FakeLlamaServer) -> list[dict[str, Any]]:
    return [body for path, body, _ in fake.received if body.get("n_predict") == 0]


@pytest.mark.parametrize(
    ("memory", "exact"),
    [
        (Memory(), False),
        (Memory(kind=SWA, n_swa=512), True),
        (Memory(kind=SWA, n_swa=512, swa_full=True), False),
        (Memory(kind=RECURRENT), True),
    ],
    ids=["dense", "swa", "swa-full", "recurrent"],
)
async def test_rule_is_probed_on_one_idle_slot(
    fakes: Any, proxy: Any, memory: Memory, exact: bool
) -> None:
    fake = await fakes(n_slots=2, memory=memory)
    client = await proxy([{**AUTO, "url": fake.url}])
    backend = await probed(client)
    assert backend.exact is exact
    sent = probes(fake)
    assert len(sent) == 2
    assert sent[0]["id_slot"] == sent[1]["id_slot"]
    assert fake.violations == []  # never a busy slot
    slot = backend.slots[sent[0]["id_slot"]]
    assert slot.content is None
    assert slot.n_tokens == len(sent[1]["prompt"])
    assert (await client.post("/v1/chat/completions", json=turn(0, 1))).status == 200


async def test_a_configured_rule_is_not_probed(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=2, memory=Memory(kind=SWA, n_swa=512))
    client = await proxy([{"url": fake.url, "kv_reuse": "prefix"}])
    assert (await client.post("/v1/chat/completions", json=turn(0, 1))).status == 200
    backend = client.server.app[SCHEDULER].fleet.backends[0]
    assert backend.reuse_known
    assert not backend.exact
    assert probes(fake) == []


async def test_disk_tier_saves_nothing_on_a_checkpoint_only_backend(
    fakes: Any, proxy: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = await fakes(n_slots=2, save_dir=tmp_path, memory=Memory(kind=SWA, n_swa=512))
    with caplog.at_level(logging.WARNING, logger="proxy.backends.reuse_probe"):
        client = await proxy([{**AUTO, "url": fake.url}], disk=disk(tmp_path, prefix_cache="full"))
        assert (await probed(client)).exact
    for session in range(3):
        assert (await client.post("/v1/chat/completions", json=turn(session, 1))).status == 200
    assert fake.slot_actions == []
    told = [r.getMessage() for r in caplog.records if "--swa-full" in r.getMessage()]
    assert len(told) == 1


async def test_disk_tier_saves_on_a_swa_full_backend(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    memory = Memory(kind=SWA, n_swa=512, swa_full=True)
    fake = await fakes(n_slots=2, save_dir=tmp_path, memory=memory)
    client = await proxy([{**AUTO, "url": fake.url}], disk=disk(tmp_path, prefix_cache="full"))
    assert not (await probed(client)).exact
    assert (await client.post("/v1/chat/completions", json=turn(0, 1))).status == 200
    assert [a[0] for a in fake.slot_actions] == ["save"]


async def test_rule_is_probed_again_after_a_restart(fakes: Any, proxy: Any) -> None:
    fake = await fakes(n_slots=2)
    client = await proxy([{**AUTO, "url": fake.url}], health={"interval_seconds": 0.05})
    assert not (await probed(client)).exact
    await fake.stop()
    # another model, and a slot count that tells the proxy it restarted
    fake = await fakes(port=fake.port, n_slots=3, memory=Memory(kind=SWA, n_swa=512))
    backend = client.server.app[SCHEDULER].fleet.backends[0]
    await until(lambda: backend.exact and backend.reuse_known, "the rule is probed again")
    assert len(probes(fake)) == 2


async def test_two_replicas_probing_one_slot_take_turns_by_its_lease(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """Each replica probes, and each leases the slot first: never both on it at once."""
    fake = await fakes(n_slots=2, prompt_s_per_token=0.0005)  # a probe holds one ~0.6 s
    replicas = [
        await proxy([{**AUTO, "url": fake.url}], redis_url=redis_server.url) for _ in range(2)
    ]
    for client in replicas:
        assert not (await probed(client)).exact
    assert len(probes(fake)) == 4
    assert fake.violations == []


async def test_the_probe_never_holds_a_slot_a_request_could_use(fakes: Any, proxy: Any) -> None:
    """A one-slot backend is not probed: a request sent as the proxy starts is served at
    once, not queued behind the probe's two prefills; on two slots the probe takes one
    only while the other stays idle, and a request sent while it runs takes that one."""
    slow = {"prompt_s_per_token": 0.002}  # a probe holds its slot ~2.5 s
    one = await fakes(n_slots=1, **slow)
    client = await proxy([{**AUTO, "url": one.url}])
    reply = await client.post("/v1/chat/completions", json=turn(0, 1))
    assert reply.status == 200
    assert "wait" not in reply.headers["X-Cache-Route"]
    assert probes(one) == []
    two = await fakes(n_slots=2, **slow)
    client = await proxy([{**AUTO, "url": two.url}])
    await until(lambda: bool(probes(two)), "the two-slot backend is probed")
    reply = await client.post("/v1/chat/completions", json=turn(0, 1))
    assert reply.status == 200
    assert "wait" not in reply.headers["X-Cache-Route"]
    assert not (await probed(client)).exact

"""The disk tier with a store written by someone else, a save directory the index lost, and
clients that write more than their share."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.core.disk.snapshots import valid_name
from proxy.disk.index import inside
from proxy.state import InMemoryStateStore
from proxy.state.redis import RedisStateStore
from testbed.probes import metric
from testbed.stack import free_port
from tests.conftest import make_settings
from tests.contract.test_state_store import to as _to
from tests.integration.test_disk_fake import disk, snapshot_files, turn
from tests.waiting import until

LLP = "llp-" + "0" * 32 + ".bin"


@pytest.fixture
def guarded_remove(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Every path the index tries to delete; one outside ``tmp_path`` is recorded, never
    deleted (``/etc/passwd`` must survive a regression of this test too)."""
    tried: list[Path] = []
    real = os.remove

    def remove(path: Any) -> None:
        tried.append(Path(path))
        if Path(path).resolve().is_relative_to(tmp_path.resolve()):
            real(path)

    monkeypatch.setattr("proxy.disk.index.os.remove", remove)
    return tried


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_stored_snapshot_names_never_reach_a_path_outside_the_save_dir(
    kind: str,
    request: pytest.FixtureRequest,
    fakes: Any,
    aiohttp_client: Any,
    tmp_path: Path,
    guarded_remove: list[Path],
) -> None:
    save, outside = tmp_path / "save", tmp_path / "outside"
    save.mkdir()
    outside.mkdir()
    victims = [tmp_path / "victim.txt", outside / "victim.txt", outside / LLP, save / "llp-zz.bin"]
    for victim in victims:
        victim.write_text("keep me")
    fake = await fakes(n_slots=2, save_dir=save)
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    store = RedisStateStore(url) if url else InMemoryStateStore()
    port = free_port()
    settings = make_settings(
        [fake.url],
        listen=f"127.0.0.1:{port}",
        redis_url=url,
        admin_token="t",
        disk=disk(save, prefix_cache="full", max_bytes=10**6),
    )
    app = create_app(settings, registry=CollectorRegistry(), store=store)
    client = await aiohttp_client(app, server_kwargs={"port": port})
    assert (await client.post("/v1/chat/completions", json=turn(0, 1))).status == 200
    stored = await store.all_snapshots()
    assert stored  # the full save's entries
    names = ["/etc/passwd", "../victim.txt", "llp-zz.bin", str(outside / "victim.txt")]
    names += [str(outside / LLP), f"../outside/{LLP}", "llp-" + "A" * 32 + ".bin"]
    for key, raw in stored.items():
        legit = json.loads(raw)
        # first in the list (offered before the real one), least recently used and over the
        # budget (evicted first), plus entries of the wrong shape
        hostile = [{**legit[0], "name": n, "nbytes": 10**9, "last_used": 0.0} for n in names]
        broken = [{"name": "/etc/passwd"}, [1], {**legit[0], "nbytes": "many"}]
        await store.update_snapshots(key, _to(json.dumps(hostile + broken + legit).encode()))
    await store.update_snapshots("garbage", _to(b"\xff not json"))
    for session in range(2):  # restores offered from the index, saves, budget enforced
        resp = await client.post("/v1/chat/completions", json=turn(session, 2))
        assert resp.status == 200
    status = await client.get("/admin/disk", headers=bearer("t"))  # reads the index too
    assert status.status == 200
    assert all(victim.read_text() == "keep me" for victim in victims)
    assert exists(Path("/etc/passwd"))
    assert all(valid_name(name) for _, _, name in fake.slot_actions)
    assert [a[0] for a in fake.slot_actions].count("save") >= 2  # the real ones still work
    assert all(p.parent == save.resolve() and valid_name(p.name) for p in guarded_remove)


def test_a_name_is_a_path_inside_the_directory_only(tmp_path: Path) -> None:
    save = tmp_path / "save"
    save.mkdir()
    assert inside(save, LLP) == (save / LLP).resolve()
    (save / ("llp-" + "1" * 32 + ".bin")).symlink_to(tmp_path / "elsewhere")
    assert inside(save, "llp-" + "1" * 32 + ".bin") is None  # a link out of it
    for name in ("/etc/passwd", "../x", "llp-zz.bin", str(save / LLP)):
        assert inside(save, name) is None


def exists(path: Path) -> bool:
    return path.exists()


def size(path: Path) -> int:
    return path.stat().st_size


def snapshots_by_age(directory: Path) -> list[Path]:
    """The files named as the proxy names snapshots, oldest first."""
    found = [p for p in directory.glob("llp-*.bin") if valid_name(p.name)]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def age(*paths: Path, seconds: float = 3600.0) -> None:
    """Make files look written ``seconds`` ago, oldest first (past the stray grace)."""
    now = time.time()
    for i, path in enumerate(paths):
        os.utime(path, (now - seconds + i, now - seconds + i))


async def test_files_the_index_lost_are_counted_and_deleted_after_a_restart(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    other, bad_name = tmp_path / "notes.txt", tmp_path / "llp-zz.bin"
    other.write_bytes(b"x" * 50_000)  # not a snapshot name: never counted or deleted
    bad_name.write_bytes(b"x" * 50_000)
    fake = await fakes(n_slots=1, save_dir=tmp_path)
    settings = disk(tmp_path, prefix_cache="full", max_bytes=9000, reconcile_seconds=0)
    for restart in range(3):  # each proxy starts with an empty index (in-memory store)
        client = await proxy([fake], disk=settings)
        for session in range(2):  # each full snapshot is ~4 KB in the fake
            body = turn(10 * restart + session, 1)
            assert (await client.post("/v1/chat/completions", json=body)).status == 200
        await client.close()
        age(*snapshots_by_age(tmp_path))
    saved = [a[2] for a in fake.slot_actions]
    assert len(saved) == 6
    assert snapshot_files(tmp_path) == set(saved[-2:]) | {"llp-zz.bin"}  # the two newest
    assert sum(size(p) for p in snapshots_by_age(tmp_path)) <= 9000
    assert size(other) == size(bad_name) == 50_000

    # at start-up and periodically: strays left by anyone are brought within the budget
    strays = [tmp_path / f"llp-{i:032x}.bin" for i in range(4)]
    for stray in strays:
        stray.write_bytes(b"x" * 4000)
    age(*strays)
    client = await proxy([fake], disk={**settings, "reconcile_seconds": 0.05})
    assert (await client.get("/healthz")).status == 200
    await until(lambda: len(snapshot_files(tmp_path)) <= 3, "the strays are deleted")
    assert snapshot_files(tmp_path) == {strays[-1].name, strays[-2].name, "llp-zz.bin"}
    text = await (await client.get("/metrics")).text()
    assert metric(text, "llama_cache_proxy_disk_events_total", event="stray") == 4
    strays[0].write_bytes(b"x" * 4000)
    age(strays[0], seconds=7200)  # the oldest of three: deleted by the periodic pass
    await until(lambda: not exists(strays[0]), "the periodic pass deletes the oldest")
    assert exists(other)
    assert exists(bad_name)


async def test_a_client_over_its_write_cap_is_served_without_saves(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    fake = await fakes(n_slots=1, save_dir=tmp_path)
    capped = disk(tmp_path, prefix_cache="full", client_max_bytes=5000)
    client = await proxy([fake], disk=capped)
    for session in range(4):  # ~4 KB per full snapshot: the second crosses 5000 bytes
        body = turn(session, 1)
        resp = await client.post("/v1/chat/completions", json=body, headers=bearer("a"))
        assert resp.status == 200
    assert len(fake.slot_actions) == 2
    resp = await client.post("/v1/chat/completions", json=turn(9, 1), headers=bearer("b"))
    assert resp.status == 200
    assert len(fake.slot_actions) == 3  # another client has its own cap
    text = await (await client.get("/metrics")).text()
    assert metric(text, "llama_cache_proxy_disk_events_total", event="capped") == 2


async def test_saves_of_one_client_at_once_count_against_each_other(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    fake = await fakes(n_slots=4, save_dir=tmp_path)
    fake.save_s = 0.2  # every save is in flight while the others are asked for
    capped = disk(tmp_path, prefix_cache="full", client_max_bytes=5000)
    client = await proxy([fake], disk=capped)

    async def ask(session: int) -> int:
        body = turn(session, 1)
        resp = await client.post("/v1/chat/completions", json=body, headers=bearer("a"))
        return int(resp.status)

    assert await asyncio.gather(*(ask(s) for s in range(4))) == [200] * 4
    saves = [a for a in fake.slot_actions if a[0] == "save"]
    assert 1 <= len(saves) <= 2  # ~4 KB each: as many as one after the other, at most
    text = await (await client.get("/metrics")).text()
    assert metric(text, "llama_cache_proxy_disk_events_total", event="capped") == 4 - len(saves)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}

"""One contract, two implementations: in-memory and a real redis-server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis as sync_redis

from proxy.state import (
    InMemoryStateStore,
    SlotRecord,
    SlotView,
    StateStore,
    StateStoreUnavailable,
    keys,
)
from proxy.state.base import LEFT, SNAPSHOT_ATTEMPTS, SlotRef
from proxy.state.redis import RedisStateStore
from testbed.stack import RedisServer
from tests.relay import Relay


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = RedisServer().start()
    yield server.url
    server.stop()


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def store(request: Any) -> AsyncIterator[StateStore]:
    if request.param == "memory":
        yield InMemoryStateStore()
        return
    url = request.getfixturevalue("redis_url")
    redis = RedisStateStore(url)
    await redis._redis.flushdb()  # each test starts empty
    yield redis
    await redis.close()


def now() -> float:
    return time.time()


class Clock:
    """The time a test gives its store, and time passing for the store's expiries. The
    in-memory store reads only the ``now`` it is given, so its time is moved on at once;
    Redis expires keys on its own clock, so on Redis the time really passes (the waiting is
    what is tested: the server's expiry)."""

    def __init__(self, store: StateStore) -> None:
        self.fake = isinstance(store, InMemoryStateStore)
        self._at = time.time()

    def now(self) -> float:
        return self._at if self.fake else time.time()

    async def passes(self, seconds: float) -> None:
        if self.fake:
            self._at += seconds
        else:
            await asyncio.sleep(seconds)


@pytest.fixture
def clock(store: StateStore) -> Clock:
    return Clock(store)


async def test_affinity_roundtrip_and_expiry(store: StateStore, clock: Clock) -> None:
    assert await store.get_affinity("k", clock.now()) is None
    await store.set_affinity("k", ("b0", 1), ttl=0.2, now=clock.now())
    assert await store.get_affinity("k", clock.now()) == ("b0", 1)
    await clock.passes(0.3)
    assert await store.get_affinity("k", clock.now()) is None


async def test_lease_has_one_owner_and_only_the_owner_releases(store: StateStore) -> None:
    ref = ("b0", 0)
    assert await store.acquire_lease(ref, "r1", ttl=5, now=now())
    assert not await store.acquire_lease(ref, "r2", ttl=5, now=now())
    assert await store.acquire_lease(ref, "r1", ttl=5, now=now())  # renew
    await store.release_lease(ref, "r2")
    assert (await store.view([ref, ("b0", 1)], now())).owners == {ref: "r1"}
    await store.release_lease(ref, "r1")
    assert await store.acquire_lease(ref, "r2", ttl=5, now=now())


async def test_renewal_extends_only_a_held_lease(store: StateStore, clock: Clock) -> None:
    ref = ("b2", 0)
    assert not await store.renew_lease(ref, "r1", ttl=5, now=clock.now())  # never re-created
    assert (await store.view([ref], clock.now())).owners == {}
    assert await store.acquire_lease(ref, "r1", ttl=0.3, now=clock.now())
    assert not await store.renew_lease(ref, "r2", ttl=5, now=clock.now())
    assert await store.renew_lease(ref, "r1", ttl=5, now=clock.now())
    await clock.passes(0.4)
    assert (await store.view([ref], clock.now())).owners == {ref: "r1"}  # extended past 0.3 s
    await store.release_lease(ref, "r1")
    assert not await store.renew_lease(ref, "r1", ttl=5, now=clock.now())
    assert (await store.view([ref], clock.now())).owners == {}


async def test_lease_expires(store: StateStore, clock: Clock) -> None:
    ref = ("b1", 3)
    assert await store.acquire_lease(ref, "dead-replica", ttl=0.2, now=clock.now())
    assert not await store.acquire_lease(ref, "r2", ttl=5, now=clock.now())
    await clock.passes(0.3)
    assert await store.acquire_lease(ref, "r2", ttl=5, now=clock.now())


async def test_concurrent_takers_get_one_lease(store: StateStore) -> None:
    ref = ("b0", 2)
    results = await asyncio.gather(
        *(store.acquire_lease(ref, f"r{i}", ttl=5, now=now()) for i in range(20))
    )
    assert sum(results) == 1


async def put(store: StateStore, ref: SlotRef, record: SlotRecord, at: float) -> SlotRecord:
    """Write ``record``; it is stored as the store stamped it."""
    return replace(record, updated_at=await store.put_slot(ref, record, ttl=5, now=at))


async def test_slot_records(store: StateStore) -> None:
    record = SlotRecord((1, 2**63 + 5), (10, 20), 2, 19, 0.0)
    before = now()
    stored = await put(store, ("b0", 0), record, before)
    assert before - 0.001 <= stored.updated_at <= now() + 0.001  # stamped when written
    got = await store.view([("b0", 0), ("b0", 1)], now())
    assert got.records == {("b0", 0): stored}
    assert got.now is not None
    assert got.now >= stored.updated_at - 0.001  # (stamps are whole milliseconds)
    await store.clear_slots([("b0", 0)])
    assert (await store.view([("b0", 0)], now())).records == {}


async def test_a_sealed_record_stays_sealed(store: StateStore) -> None:
    """A raw prompt's slot content, kept with its reply (``Fingerprint.sealed``), reads back
    sealed on every replica."""
    stored = await put(store, ("b0", 0), SlotRecord((7,), (3,), 5, 9, 0.0, sealed=True), now())
    assert (await store.view([("b0", 0)], now())).records == {("b0", 0): stored}
    assert stored.sealed
    assert stored.anchor == 5


async def test_a_record_keeps_its_user_message_segments(store: StateStore) -> None:
    """Where a chat content's user messages start (``Fingerprint.users``: the checkpoints a
    sliding-window or recurrent backend rolls back to) reads back on every replica, so their
    predictions there follow the checkpoints as the writer's do."""
    record = SlotRecord((7, 8, 9), (100, 140, 200), 2, 210, 0.0, users=(1, 2))
    stored = await put(store, ("b0", 0), record, now())
    assert (await store.view([("b0", 0)], now())).records == {("b0", 0): stored}
    assert stored.users == (1, 2)


def test_a_record_with_a_user_segment_past_its_segments_is_refused() -> None:
    """Anything in the store may have been written by anyone: a user-message segment past
    the record's segments, or one whose bytes do not add up, is no record."""
    good = SlotRecord((7, 8), (100, 140), 1, 150, 0.0, users=(1,))
    assert SlotRecord.unpack(good.pack()) == replace(good, updated_at=0.0)
    bad = SlotRecord((7, 8), (100, 140), 1, 150, 0.0, users=(5,)).pack()
    for raw in (bad, good.pack()[:-13], good.pack() + b"\0"):
        with pytest.raises(ValueError):
            SlotRecord.unpack(raw)


async def test_the_view_holds_leases_and_records_of_the_same_slots(store: StateStore) -> None:
    stored = await put(store, ("b0", 1), SlotRecord((7,), (3,), 1, 3, 0.0), now())
    assert await store.acquire_lease(("b1", 0), "r1", ttl=5, now=now())
    refs = [("b0", 0), ("b0", 1), ("b1", 0)]
    assert await store.view(refs, now()) == SlotView({("b1", 0): "r1"}, {("b0", 1): stored})
    assert await store.view([], now()) == SlotView({}, {})


async def test_the_view_leaves_out_records_not_newer_than_the_callers(store: StateStore) -> None:
    """A replica reads each record once: a record no newer than the one it holds (same stamp,
    to the millisecond) is not sent again; a newer one, or one it does not hold, is."""
    first = await put(
        store, ("b0", 0), SlotRecord((7,) * 300, tuple(range(1, 301)), 1, 300, 0), now()
    )
    other = await put(store, ("b0", 1), SlotRecord((8,), (3,), 1, 3, 0.0), now())
    assert await store.acquire_lease(("b0", 0), "r1", ttl=5, now=now())
    refs = [("b0", 0), ("b0", 1), ("b0", 2)]
    held = {("b0", 0): first.updated_at, ("b0", 1): other.updated_at - 0.001, ("b0", 2): 1.0}
    got = await store.view(refs, now(), held)
    assert got == SlotView({("b0", 0): "r1"}, {("b0", 1): other})
    later = {("b0", 1): other.updated_at + 0.0004}  # the same millisecond
    assert (await store.view(refs, now(), later)).records == {("b0", 0): first}
    assert (await store.view(refs, now(), {})).records == {("b0", 0): first, ("b0", 1): other}


async def test_a_record_is_newer_than_the_one_it_replaces(store: StateStore) -> None:
    """Writes to one slot within one millisecond still stamp each later than the last, so a
    replica holding one record reads the next."""
    ref = ("b0", 0)
    stamps = [
        (await put(store, ref, SlotRecord((i,), (3,), 1, 3, 0.0), now())).updated_at
        for i in range(20)
    ]
    assert stamps == sorted(set(stamps))
    got = await store.view([ref], now(), {ref: stamps[-2]})
    assert [r.hashes for r in got.records.values()] == [(19,)]


async def test_window_is_bounded_newest_first(store: StateStore) -> None:
    for i in range(5):
        await store.push_window("model", f"e{i}".encode(), limit=3, ttl=5, now=now())
    assert await store.window("model", now()) == [b"e4", b"e3", b"e2"]


async def test_replicas_are_the_live_heartbeats(store: StateStore, clock: Clock) -> None:
    assert (await store.heartbeat("b", 5.0, clock.now())).ids() == ["b"]
    assert (await store.heartbeat("a", 0.3, clock.now())).ids() == ["a", "b"]
    await clock.passes(0.4)
    assert (await store.heartbeat("c", 0.3, clock.now())).ids() == ["b", "c"]  # a's expired
    await clock.passes(0.4)
    assert (await store.heartbeat("a", 5.0, clock.now())).ids() == ["a", "b"]  # and c's


async def test_a_heartbeat_lists_each_entry_with_when_it_lapses_on_the_stores_clock(
    store: StateStore, clock: Clock
) -> None:
    """An entry lives ``ttl`` or up to the expiry its writer gives, if sooner; it replaces
    the writer's previous entry; a read gives the store's time and every entry's score, so
    the reader can judge entries anyone may have written (``core.replicas.auth``)."""
    first = await store.heartbeat("a|1", 5.0, clock.now())
    assert first.ids() == ["a|1"]
    assert first.now < first.entries[0][1] <= first.now + 5.0
    capped = await store.heartbeat("a|2", 5.0, clock.now(), first.now + 0.3, "a|1")
    ((entry, expires),) = capped.entries
    assert entry == "a|2"
    assert expires == pytest.approx(first.now + 0.3, abs=0.01)
    await clock.passes(0.4)
    assert (await store.heartbeat("b", 5.0, clock.now())).ids() == ["b"]  # a|2 lapsed


async def test_a_replica_that_leaves_stops_being_live_and_is_listed_as_left(
    store: StateStore, clock: Clock
) -> None:
    await store.heartbeat("a", 5.0, clock.now())
    await store.heartbeat("b", 5.0, clock.now())
    await store.leave("a", 0.3, clock.now())
    assert (await store.heartbeat("b", 5.0, clock.now())).ids() == ["a" + LEFT, "b"]
    await store.leave("b", 0.3, clock.now(), mark="b-signed-mark")
    listed = (await store.heartbeat("c", 5.0, clock.now())).ids()
    assert listed == ["a" + LEFT, "b-signed-mark", "c"]
    await clock.passes(0.4)
    assert (await store.heartbeat("b", 5.0, clock.now())).ids() == ["b", "c"]  # marks expire


@pytest.mark.redis
async def test_a_redis_store_judges_liveness_returns_and_records_by_its_own_clock(
    redis_url: str,
) -> None:
    """Replicas on machines whose clocks differ: one 2 s ahead of another must still list
    it as live (a 1 s heartbeat TTL, as the proxy uses), a release registered by a replica
    whose clock is 30 s behind is claimed as just made, and its slot record is read as the
    newest."""
    ahead, behind = RedisStateStore(redis_url), RedisStateStore(redis_url)
    await ahead._redis.flushdb()
    try:
        for _ in range(3):
            await behind.heartbeat("behind", 1.0, now() - 1.0)
            assert (await ahead.heartbeat("ahead", 1.0, now() + 1.0)).ids() == ["ahead", "behind"]
            assert (await behind.heartbeat("behind", 1.0, now() - 1.0)).ids() == ["ahead", "behind"]
            await asyncio.sleep(0.2)  # rounds apart on Redis's clock: the time passing is tested
        await behind.leave("behind", 1.0, now() - 1.0)
        assert (await ahead.heartbeat("ahead", 1.0, now() + 1.0)).ids() == [
            "ahead",
            "behind" + LEFT,
        ]
        await behind.put_release("behind:1", [50], ttl=60, now=now() - 30)
        found = await ahead.claim_release([50], ttl=60, now=now() + 1.0)
        assert found is not None
        assert found[0] == "behind:1"
        assert 0.0 <= found[1] < 1.0
        # a slot record written by the replica 30 s behind, after one written by the replica
        # ahead, is the newer one, and was written just now
        ref = ("b0", 0)
        first = await put(ahead, ref, SlotRecord((1,), (3,), 1, 3, 0.0), now() + 30)
        second = await put(behind, ref, SlotRecord((2,), (3,), 1, 3, 0.0), now() - 30)
        got = await ahead.view([ref], now() + 30, {ref: first.updated_at})
        assert got.records == {ref: second}
        assert got.now is not None
        assert -0.01 < got.now - second.updated_at < 1.0  # (a stamp may be 1 ms ahead)
    finally:
        await ahead.close()
        await behind.close()


async def test_ping(store: StateStore) -> None:
    await store.ping()


async def test_unreachable_redis_raises_unavailable() -> None:
    store = RedisStateStore("redis://127.0.0.1:9/0")
    with pytest.raises(StateStoreUnavailable):
        await store.get_affinity("k", now())
    with pytest.raises(StateStoreUnavailable):
        await store.acquire_lease(("b", 0), "r", 1, now())
    await store.close()


@pytest.mark.redis
async def test_a_slow_redis_is_not_down(redis_url: str) -> None:
    """On local state two replicas can pin one slot, so a Redis that answers late (here
    every reply and the connection held back 0.4 s, as on a CPU-starved host) must not be
    taken for an outage; an unreachable one still is (above)."""
    relay = Relay(redis_url, lag=0.4)
    slow = RedisStateStore(await relay.start())
    try:
        assert await slow.acquire_lease(("slow", 0), "r", 5, now())
        assert (await slow.view([("slow", 0)], now())).owners == {("slow", 0): "r"}
        await slow.release_lease(("slow", 0), "r")
    finally:
        await slow.close()
        await relay.close()


def to(value: bytes | None) -> Callable[[bytes | None], bytes | None]:
    return lambda _: value


async def test_snapshot_index_update_get_list(store: StateStore) -> None:
    assert await store.get_snapshots(["a", "b"]) == {}
    assert await store.update_snapshots("a", to(b"[1]"))
    assert await store.update_snapshots("b", to(b"[2]"))
    seen: list[bytes | None] = []

    def change(old: bytes | None) -> bytes:
        seen.append(old)
        return b"[3]"

    assert await store.update_snapshots("a", change)
    assert seen == [b"[1]"]  # the change reads the current value
    assert await store.get_snapshots(["a", "b", "c"]) == {"a": b"[3]", "b": b"[2]"}
    assert await store.all_snapshots() == {"a": b"[3]", "b": b"[2]"}
    assert await store.update_snapshots("a", to(None))  # deletes
    assert await store.update_snapshots("missing", to(None))
    assert await store.all_snapshots() == {"b": b"[2]"}
    assert await store.get_snapshots([]) == {}


async def test_snapshot_index_changes_made_at_once_are_all_kept(store: StateStore) -> None:
    """Replicas and backends change one key at once (the same prefix saved in several
    directories): each change is made on the value the others left, none is lost."""

    def add(item: int) -> Callable[[bytes | None], bytes | None]:
        return lambda old: json.dumps([*json.loads(old or b"[]"), item]).encode()

    done = await asyncio.gather(*(store.update_snapshots("k", add(i)) for i in range(8)))
    assert all(done)
    assert sorted(json.loads((await store.get_snapshots(["k"]))["k"])) == list(range(8))


@pytest.mark.redis
async def test_a_snapshot_index_change_outrun_every_time_gives_up(redis_url: str) -> None:
    """A change that another writer beats on every try is dropped after
    ``SNAPSHOT_ATTEMPTS`` tries, reported False, and leaves the other's value."""
    store, other = RedisStateStore(redis_url), sync_redis.Redis.from_url(redis_url)
    await store._redis.flushdb()
    tries = []

    def outrun(old: bytes | None) -> bytes:
        tries.append(old)
        other.hset(keys.SNAPSHOTS, "k", f"[{len(tries)}]")  # between our read and our write
        return b"[0]"

    try:
        assert not await store.update_snapshots("k", outrun)
        assert len(tries) == SNAPSHOT_ATTEMPTS
        assert tries[1:] == [f"[{n}]".encode() for n in range(1, SNAPSHOT_ATTEMPTS)]
        assert await store.get_snapshots(["k"]) == {"k": f"[{SNAPSHOT_ATTEMPTS}]".encode()}
    finally:
        other.close()
        await store.close()


async def test_a_release_is_claimed_once_by_its_latest_hash(
    store: StateStore, clock: Clock
) -> None:
    """The release under the last hash that has one names what a prompt continues; once
    claimed (by any replica) it is never returned again, and older releases still are; a
    claim says how many seconds ago its release was registered."""
    await store.put_release("r1:1", [10, 11], ttl=5, now=clock.now())
    await clock.passes(0.2)
    await store.put_release("r2:7", [20, 21, 22], ttl=5, now=clock.now())
    first = await store.claim_release([1, 10, 11, 2], ttl=5, now=clock.now())
    assert first is not None
    assert first[0] == "r1:1"
    assert 0.2 <= first[1] < 2.0
    assert await store.claim_release([10, 11], ttl=5, now=clock.now()) is None
    second = await store.claim_release([10, 21, 3], ttl=5, now=clock.now())
    assert second is not None
    assert second[0] == "r2:7"
    assert 0.0 <= second[1] < first[1]
    assert await store.claimed(["r1:1", "r2:7", "r3:1"], now=clock.now()) == {"r1:1", "r2:7"}
    await store.put_release("r3:1", [10, 30], ttl=5, now=clock.now())  # a later release of 10
    third = await store.claim_release([10], ttl=5, now=clock.now())
    assert third is not None
    assert third[0] == "r3:1"
    assert await store.claim_release([], ttl=5, now=clock.now()) is None


async def test_releases_and_their_claims_expire(store: StateStore, clock: Clock) -> None:
    await store.put_release("r1:1", [40], ttl=0.2, now=clock.now())
    await store.put_release("r1:2", [41], ttl=5, now=clock.now())
    assert await store.claim_release([41], ttl=0.2, now=clock.now()) is not None
    await clock.passes(0.3)
    assert await store.claim_release([40], ttl=5, now=clock.now()) is None
    assert await store.claimed(["r1:2"], now=clock.now()) == set()


async def test_a_record_keeps_its_system_messages_pieces(store: StateStore) -> None:
    """A long system message's pieces (``Fingerprint.parts``: where two prompts part inside
    it) read back on every replica, so its predictions there reach into the message too;
    pieces that do not fit their record are no record."""
    parts = ((1, 2048, bytes(range(32))),)
    record = SlotRecord((7, 8, 9), (100, 140, 200), 2, 210, 0.0, users=(2,), parts=parts)
    stored = await put(store, ("b0", 0), record, now())
    assert (await store.view([("b0", 0)], now())).records == {("b0", 0): stored}
    assert stored.parts == parts
    assert SlotRecord.unpack(record.pack()) == replace(record, updated_at=0.0)
    for wrong in (((5, 2048, bytes(8)),), ((1, 2048, bytes(7)),)):
        with pytest.raises(ValueError):
            SlotRecord.unpack(replace(record, parts=wrong).pack())
    with pytest.raises(ValueError):
        SlotRecord.unpack(record.pack()[:-13])

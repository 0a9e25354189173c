"""Several proxy replicas sharing one real Redis, in front of fake llama-servers."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from typing import Any

import pytest

from testbed.probes import metric, until_listed
from tests.conftest import chat, delta_text, events_to_done
from tests.integration import test_holds_fake as holds
from tests.integration.test_routing_fake import SYSTEM
from tests.waiting import ADMIN, PLACED, admin_view, once_placed, until, until_metric


def urls(clients: list[Any]) -> list[str]:
    return [str(c.make_url("")).rstrip("/") for c in clients]


async def test_two_replicas_keep_a_session_on_its_slot(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    backends = [await fakes(n_slots=2) for _ in range(2)]
    a = await proxy(backends, redis_url=redis_server.url)
    b = await proxy(backends, redis_url=redis_server.url)
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    seen = []
    for turn in range(6):
        client = (a, b)[turn % 2]
        history.append({"role": "user", "content": f"turn {turn} " + "word " * 30})
        resp = await client.post(
            "/v1/chat/completions", json={"messages": history, "max_tokens": 6}
        )
        body = await resp.json()
        seen.append((resp.headers["X-Cache-Backend"], resp.headers["X-Cache-Slot"]))
        if turn:
            timings = body["timings"]
            assert timings["cache_n"] > 0.9 * (timings["prompt_n"] + timings["cache_n"]) - 20
        history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    assert len(set(seen)) == 1, seen


async def test_a_streamed_turn_ends_after_its_slot_is_given_back_and_recorded(
    fakes: Any, proxy: Any, redis_server: Any, monkeypatch: Any
) -> None:
    """A streaming client sends its next turn as soon as it reads ``[DONE]``, here to the other
    replica. ``[DONE]`` comes only after the lease is given back and the slot's record
    written (Redis made slow to give leases back: 0.3 s), so the other replica sees the slot
    free and holding the session. Before, the end came first: the other replica saw the slot
    leased, with no record of the session, and placed the turn on another slot."""
    from proxy.state.redis import RedisStateStore

    original = RedisStateStore.release_lease

    async def slow(self: Any, ref: Any, owner: str) -> None:
        await asyncio.sleep(0.3)  # the slow give-back is the fault tested
        await original(self, ref, owner)

    monkeypatch.setattr(RedisStateStore, "release_lease", slow)
    backends = [await fakes(n_slots=2)]
    a = await proxy(backends, redis_url=redis_server.url)
    b = await proxy(backends, redis_url=redis_server.url)
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    history.append({"role": "user", "content": "turn 0 " + "word " * 30})
    first = await a.post(
        "/v1/chat/completions", json={"messages": history, "max_tokens": 6, "stream": True}
    )
    reply = delta_text(await events_to_done(first))  # an SDK stops reading at [DONE]
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    second = await b.post("/v1/chat/completions", json={"messages": history, "max_tokens": 6})
    assert second.headers["X-Cache-Slot"] == first.headers["X-Cache-Slot"]
    timings = (await second.json())["timings"]
    assert timings["cache_n"] > 0.9 * (timings["prompt_n"] + timings["cache_n"]) - 20


async def test_replicas_never_pin_one_slot_at_once(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    backends = [await fakes(n_slots=2, gen_s_per_token=0.003) for _ in range(2)]
    replicas = [await proxy(backends, redis_url=redis_server.url) for _ in range(3)]
    bodies = [
        chat(f"shared system prompt. request {i} " + "x " * 20, max_tokens=6, stream=i % 2 == 0)
        for i in range(36)
    ]
    responses = await asyncio.gather(
        *(replicas[i % 3].post("/v1/chat/completions", json=body) for i, body in enumerate(bodies))
    )
    assert [r.status for r in responses] == [200] * 36
    assert all(f.violations == [] for f in backends)


async def test_a_request_that_needs_the_whole_backend_leases_every_slot_of_it(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """``n`` = 2: the server picks the slots, so the request holds the whole backend. It
    leased none of them: another replica pinned one while it ran."""
    backend = await fakes(n_slots=2, gen_s_per_token=0.05)
    a = await proxy([backend], redis_url=redis_server.url)
    b = await proxy([backend], redis_url=redis_server.url)
    both = await once_placed(
        a.post("/v1/chat/completions", json=chat("two", n=2, max_tokens=40)), a, b
    )
    other = await b.post("/v1/chat/completions", json=chat("other", max_tokens=4))
    assert other.status == 200
    assert (await both).status == 200
    assert backend.violations == []


async def test_a_lease_the_store_lost_is_taken_again_while_its_request_runs(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """Redis loses its keys (flushed, failed over, evicted) while replica A runs a request:
    A's renewal finds the lease gone and takes it again, so B does not pin the running slot."""
    import redis.asyncio as aioredis

    backend = await fakes(n_slots=1, gen_s_per_token=0.05)
    no_forwarding = {"secret": None}
    a = await proxy([backend], redis_url=redis_server.url, replicas=no_forwarding)
    b = await proxy([backend], redis_url=redis_server.url, replicas=no_forwarding)
    store = aioredis.from_url(redis_server.url)
    try:
        running = await once_placed(
            a.post("/v1/chat/completions", json=chat("long", max_tokens=60)), a
        )

        async def leased() -> bool:
            return bool(await store.keys("*lease*"))

        await until(leased, "A's lease")
        await store.flushall()
        await until(leased, "A's lease taken again")
        other = await b.post("/v1/chat/completions", json=chat("other", max_tokens=4))
        assert other.status == 200
        assert (await running).status == 200
        assert backend.violations == []
    finally:
        await store.aclose()


async def test_a_refused_lease_does_not_hand_its_slot_to_a_waiter_as_another_replicas(
    fakes: Any, proxy: Any, redis_server: Any, monkeypatch: Any
) -> None:
    """Request A is placed on the only slot, but its lease is refused (another replica holds
    it); B waits in the same replica. Giving A's claim back woke B, which took the slot, and
    only then was the slot marked as the other replica's, over B's claim. The next refresh
    found no other replica's lease and freed the slot while B ran on it, and A was pinned
    there too: the same slot twice from one replica (seen as a flaky failure of
    test_replicas_never_pin_a_slot_twice_and_dead_leases_expire). The slot is now marked
    the other replica's as the claim is given back, before any waiter is woken."""
    from proxy.state.redis import RedisStateStore

    original = RedisStateStore.acquire_lease
    refused: list[Any] = []
    asked, b_waits = asyncio.Event(), asyncio.Event()

    async def refuse_first(self: Any, *args: Any) -> bool:
        if not refused:
            refused.append(True)
            asked.set()
            await b_waits.wait()  # B arrives and waits meanwhile
            return False
        return await original(self, *args)

    monkeypatch.setattr(RedisStateStore, "acquire_lease", refuse_first)
    backend = await fakes(n_slots=1, gen_s_per_token=0.1)
    replica = await proxy([backend], redis_url=redis_server.url)
    first = asyncio.create_task(replica.post("/v1/chat/completions", json=chat("a", max_tokens=8)))
    await asyncio.wait_for(asked.wait(), 10)  # A is placed; its lease is asked for
    second = asyncio.create_task(replica.post("/v1/chat/completions", json=chat("b", max_tokens=8)))
    await until_metric(replica, "llama_cache_proxy_requests_queued", lambda n: n == 1)
    b_waits.set()
    assert [(await second).status, (await first).status] == [200, 200]
    assert refused
    assert backend.violations == []


async def test_replicas_that_lose_redis_split_the_slots_instead_of_sharing_them(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """Redis down: leases are local only, so the replicas that knew each other (heartbeats)
    pin disjoint parts of the fleet; every request is still served."""
    backends = [await fakes(n_slots=2, gen_s_per_token=0.003) for _ in range(2)]
    replicas = [await proxy(backends, redis_url=redis_server.url) for _ in range(3)]
    await until_listed(urls(replicas))  # each replica has read the others
    redis_server.stop()
    bodies = [chat(f"request {i} " + "y " * 20, max_tokens=6) for i in range(36)]
    responses = await asyncio.gather(
        *(replicas[i % 3].post("/v1/chat/completions", json=body) for i, body in enumerate(bodies))
    )
    assert [r.status for r in responses] == [200] * 36
    assert all(f.violations == [] for f in backends)
    used: list[set[tuple[str, str]]] = [set(), set(), set()]
    for i, r in enumerate(responses):
        used[i % 3].add((r.headers["X-Cache-Backend"], r.headers["X-Cache-Slot"]))
    assert all(used[a].isdisjoint(used[b]) for a in range(3) for b in range(a + 1, 3)), used
    page = await (await replicas[0].get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_state_store_up") == 0


async def rarely_probing_pair(
    fakes: Any, proxy: Any, redis_url: str, gen: float, **b: Any
) -> tuple[Any, Any, Any]:
    """A fake with 2 slots and replicas A and B that have read each other's heartbeats; A
    probes rarely (the default is 2 s), so what it knows of B's requests comes from the store
    (its slot table is open to ``ADMIN``). Neither forwards: each runs what it is sent."""
    backend = await fakes(n_slots=2, gen_s_per_token=gen)
    rare, off = {"interval_seconds": 60}, "off"
    a = await proxy([backend], redis_url=redis_url, health=rare, admin_token=ADMIN, replica_url=off)
    b_client = await proxy([backend], redis_url=redis_url, replica_url=off, **b)
    await until_listed(urls([a, b_client]))
    return backend, a, b_client


@pytest.mark.parametrize("seen", [True, False], ids=["leases-seen", "leases-not-yet-seen"])
async def test_a_replica_serves_through_an_outage_that_began_on_another_replicas_leases(
    fakes: Any, proxy: Any, redis_server: Any, seen: bool
) -> None:
    """Redis dies while replica B runs requests on both slots. If A had seen them leased,
    nothing could end those leases with the store gone: A queued everything until Redis came
    back (a stalled replica for the whole outage), or, when its first failed call was the
    view read, freed both slots at once and pinned one B was still generating on. If A's
    view (read every 0.5 s) had not seen them yet, it pinned one of them as idle. Every slot
    A is not running on now drains: A pins its part once ``/slots`` shows it idle."""
    backend, a, b = await rarely_probing_pair(fakes, proxy, redis_server.url, 0.03)
    long = [
        asyncio.create_task(b.post("/v1/chat/completions", json=chat(f"long {i}", max_tokens=60)))
        for i in range(2)
    ]
    await until_metric(b, PLACED, lambda n: n == 2)  # both leased

    async def a_sees_both_leased() -> bool:
        slots = (await admin_view(a, backend))["slots"]
        return [s["phase"] for s in slots] == ["remote", "remote"]

    if seen:  # A's background refresh (every 0.5 s) has seen both slots leased
        await until(a_sees_both_leased, "A sees both slots leased")
    redis_server.stop()
    resp = await asyncio.wait_for(
        a.post("/v1/chat/completions", json=chat("short", max_tokens=4)), timeout=15
    )
    assert [resp.status] + [(await t).status for t in long] == [200] * 3
    page = await (await a.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_state_store_up") == 0  # served on local state
    assert backend.violations == []


async def test_slots_pinned_during_an_outage_stay_theirs_when_redis_returns(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """During an outage each replica pins its own part without leases. When Redis returned,
    nothing in it said those slots were busy: a replica took another's running slot at once
    (no lease on it) and pinned it twice. Now each replica leases what it is running as it
    reconnects, and keeps to its own part for a heartbeat period after, until its peers
    have reconnected and done the same."""
    rare = {"interval_seconds": 60}
    backend, a, b = await rarely_probing_pair(fakes, proxy, redis_server.url, 0.045, health=rare)
    redis_server.stop()
    long = [  # each on its own replica's part of the fleet; B's runs ~4.5 s, A's ~1.8 s
        await once_placed(r.post("/v1/chat/completions", json=chat(f"long {n}", max_tokens=n)), r)
        for n, r in ((40, a), (100, b))
    ]
    redis_server.start()
    for r in (a, b):
        await until_metric(r, "llama_cache_proxy_state_store_up", lambda n: n == 1)
    back = time.monotonic()
    short = [await a.post("/v1/chat/completions", json=chat("short", max_tokens=4))]
    # past the heartbeat period the replicas keep to their parts after Redis returns: the
    # proxy's own timer (no clock to inject), so the time passing is what is tested
    await asyncio.sleep(max(0.0, back + 2.1 - time.monotonic()))
    short.append(await a.post("/v1/chat/completions", json=chat("again", max_tokens=4)))
    assert not long[1].done()  # B's request still ran: only its lease kept A off its slot
    assert [r.status for r in short] + [(await t).status for t in long] == [200] * 4
    assert backend.violations == []


async def test_redis_outage_degrades_to_local_state_and_resyncs(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    backends = [await fakes(n_slots=2)]
    client = await proxy(backends, redis_url=redis_server.url)
    body = chat("before " * 40, max_tokens=4, prompt_cache_key="s1")
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    redis_server.stop()
    statuses = [(await client.post("/v1/chat/completions", json=body)).status for _ in range(5)]
    assert statuses == [200] * 5
    page = await (await client.get("/metrics")).text()
    assert metric(page, "llama_cache_proxy_state_store_up") == 0
    assert metric(page, "llama_cache_proxy_state_store_errors_total") >= 1
    redis_server.start()
    await until_metric(client, "llama_cache_proxy_state_store_up", lambda n: n == 1)
    assert (await client.post("/v1/chat/completions", json=body)).status == 200


async def test_a_stalled_redis_is_not_asked_again_until_it_answers(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """Redis stops answering (SIGSTOP: connections open, replies never come). Once a call has
    timed out the store counts as down, and requests are served on local state without
    asking it: before, each request's affinity, release and record calls each waited out the
    socket timeout, about 3 s a request for the whole outage."""
    client = await proxy([await fakes(n_slots=2)], redis_url=redis_server.url)
    body = chat("before " * 40, max_tokens=4, prompt_cache_key="s1")
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
        await until_metric(client, "llama_cache_proxy_state_store_up", lambda n: n == 0)
        errors = "llama_cache_proxy_state_store_errors_total"
        before = metric(await (await client.get("/metrics")).text(), errors)
        for _ in range(4):
            assert (await client.post("/v1/chat/completions", json=body)).status == 200
        assert metric(await (await client.get("/metrics")).text(), errors) == before
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    await until_metric(client, "llama_cache_proxy_state_store_up", lambda n: n == 1)
    assert (await client.post("/v1/chat/completions", json=body)).status == 200


async def alternating(a: Any, b: Any) -> tuple[int, int, Any]:
    """Session W's turns alternate replicas ``a`` and ``b`` (so both learn how soon sessions
    come back); then A's first turn runs through ``a`` while a stranger queues at ``b``, and
    A's next turn goes to ``b`` 0.6 s after its reply. Returns A's first prompt size, what
    A's next turn reused, and the stranger's headers."""
    history: list[dict[str, Any]] = []
    for i in range(4):  # back 0.6 s after each reply
        body = holds.turn("W", history, f"step {i}")
        reply, _ = await holds.post((a, b)[i % 2], body)
        history += [body["messages"][-1], reply["choices"][0]["message"]]
        await asyncio.sleep(0.6)  # the session's pause: the return time the replicas learn
    # W's slot is no longer held for it: the hold's own timer (no clock to inject)
    await asyncio.sleep(1.0)
    earlier = [
        {"role": role, "content": f"A {role} {i} " + "context " * 150}
        for i in range(2)
        for role in ("user", "assistant")
    ]
    first_body = holds.turn("A", earlier, "start")  # long enough to be worth holding
    first_task = await once_placed(holds.post(a, first_body), a, b)  # A's first turn runs
    stranger = asyncio.create_task(holds.post(b, holds.turn("B", [], "hello")))
    first, _ = await first_task
    await asyncio.sleep(0.6)  # A's pause, as learned: the hold keeps the slot for it meanwhile
    history = [*first_body["messages"][1:], first["choices"][0]["message"]]
    second, _ = await holds.post(b, holds.turn("A", history, "next"))
    _, stranger_headers = await stranger
    size = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
    return size, second["timings"]["cache_n"], stranger_headers


@pytest.mark.parametrize("replica_url", ["off", "auto"])
async def test_a_slot_is_held_for_a_session_whose_turns_alternate_replicas(
    fakes: Any, proxy: Any, redis_server: Any, replica_url: str
) -> None:
    """Behind a load balancer a session's turns alternate replicas. Without forwarding
    (``off``) each replica measures how soon sessions come back through Redis (not only its
    own releases), and dates a slot another replica just freed, so the replica the session
    returns to holds the slot for it against a stranger waiting there (one slot, no RAM
    prompt cache). With forwarding every request is scheduled by the backend's home, which
    holds the slot the same way."""
    backend = await fakes(n_slots=1, ram_cache=False, gen_s_per_token=0.05, prompt_s_per_token=1e-3)
    config = [{"url": backend.url, "ram_cache": False}]
    a = await proxy(config, redis_url=redis_server.url, replica_url=replica_url)
    b = await proxy(config, redis_url=redis_server.url, replica_url=replica_url)
    size, reused, stranger_headers = await alternating(a, b)
    assert reused >= 0.9 * size  # A's history stayed in the slot
    assert stranger_headers["X-Cache-Route"].startswith("wait")
    holds = []
    for client in (a, b):
        page = await (await client.get("/metrics")).text()
        holds.append(metric(page, "llama_cache_proxy_slot_hold_seconds"))
    assert (min if replica_url == "off" else max)(holds) > 0, holds


async def test_maintenance_ends_at_shutdown_even_if_a_store_call_swallows_the_cancel() -> None:
    """redis-py 8.1 can swallow a cancellation inside a command, so the background task
    runs on; ``stopped`` ends it after its current round (a proxy's SIGTERM hung in CI)."""
    from prometheus_client import CollectorRegistry

    from proxy.core.server.fleet import Fleet
    from proxy.metrics import ProxyMetrics
    from proxy.replicas.shared_state import SharedState
    from proxy.state import InMemoryStateStore
    from proxy.state.base import Beat

    class Swallowing(InMemoryStateStore):
        beats = 0

        async def heartbeat(self, owner: str, ttl: float, now: float, *_: Any) -> Beat:
            self.beats += 1
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.2)  # the command's round trip: the cancel lands in it
            return Beat(now, [(owner, now + ttl)])

    metrics = ProxyMetrics(CollectorRegistry())
    store = Swallowing()
    shared = SharedState(store, Fleet(["b"]), metrics, time.time, enabled=True)
    task = asyncio.create_task(shared.maintain(lambda: None, every=0.01))
    await until(lambda: store.beats == 1, "the first heartbeat")  # inside the heartbeat
    task.cancel()
    await until(lambda: store.beats == 2, "a heartbeat after the cancel")
    assert not task.done()  # the cancel was swallowed: it runs on
    shared.stopped = True
    await asyncio.wait([task], timeout=5.0)
    assert task.done()


async def test_requests_arriving_together_share_one_read_of_the_view() -> None:
    """Every routed request refreshes the shared view first; those that arrive while a read
    is in flight wait for that read instead of each sending one (at 64 concurrent requests
    the reads were most of a Redis proxy's round trips). A later refresh reads again, and a
    cancelled waiter does not cancel the read the others share."""
    from prometheus_client import CollectorRegistry

    from proxy.core.server.fleet import Fleet, SlotPhase, SlotState
    from proxy.metrics import ProxyMetrics
    from proxy.replicas.shared_state import SharedState
    from proxy.state import InMemoryStateStore, SlotView

    class Counting(InMemoryStateStore):
        reads = 0
        answer = asyncio.Event()  # a read is in flight until the test lets it be answered

        async def view(self, refs: Any, now: float, known: Any = None) -> SlotView:
            self.reads += 1
            await self.answer.wait()
            return SlotView({("b", 0): "other"}, {})

    store = Counting()
    fleet = Fleet(["b"])
    fleet.backends[0].slots = [SlotState(0), SlotState(1)]
    shared = SharedState(store, fleet, ProxyMetrics(CollectorRegistry()), time.time, enabled=True)
    first = asyncio.create_task(shared.refresh())
    await until(lambda: store.reads == 1, "the first read is sent")
    together = [asyncio.create_task(shared.refresh()) for _ in range(9)]
    await asyncio.sleep(0)  # (a turn of the loop: each has arrived)
    assert not any(t.done() for t in together)
    store.answer.set()
    await asyncio.gather(*together)
    assert store.reads == 1
    assert first.done()
    assert [s.phase for s in fleet.backends[0].slots] == [SlotPhase.REMOTE, SlotPhase.IDLE]
    store.answer = asyncio.Event()
    waiter = asyncio.create_task(shared.refresh())
    await until(lambda: store.reads == 2, "the waiter's read is sent")
    waiter.cancel()
    later = asyncio.create_task(shared.refresh())  # the read goes on for this one
    await asyncio.sleep(0)  # (a turn of the loop: the cancel lands, this one arrives)
    store.answer.set()
    await later
    assert waiter.cancelled()
    assert store.reads == 2
    await shared.refresh()
    assert store.reads == 3


async def test_a_replica_reads_each_slot_record_once() -> None:
    """The view before every request used to carry every slot's record, however often it had
    been read (64 slots holding 32k-token raw prompts: 12 ms a read); now a record is sent to
    a replica only when it is newer than the one it folded or wrote itself, and still folded
    in when another replica rewrites it."""
    from prometheus_client import CollectorRegistry

    from proxy.core.prompt.fingerprint import Fingerprint
    from proxy.core.server.fleet import Fleet, SlotState
    from proxy.metrics import ProxyMetrics
    from proxy.replicas.shared_state import SharedState
    from proxy.state import InMemoryStateStore, SlotView

    class Counting(InMemoryStateStore):
        sent: list[int]

        async def view(self, refs: Any, now: float, known: Any = None) -> SlotView:
            found = await super().view(refs, now, known)
            self.sent.append(len(found.records))
            return found

    store = Counting()
    store.sent = []
    replicas = []
    clock = [time.time()]  # the replicas' wall clock, moved on by the test
    for _ in range(2):
        fleet = Fleet(["b"])
        fleet.backends[0].slots = [SlotState(0), SlotState(1)]
        metrics = ProxyMetrics(CollectorRegistry())
        shared = SharedState(store, fleet, metrics, lambda: clock[0], enabled=True)
        replicas.append((fleet, shared))
    (_, one), (fleet, two) = replicas
    await one.publish(0, 0, Fingerprint((1, 2), (10, 20)), 20)
    await one.publish(0, 1, Fingerprint((3,), (5,)), 5)
    await two.refresh()
    await two.refresh()
    await one.refresh()  # its own records: it holds them already
    assert store.sent == [2, 0, 0]
    assert fleet.backends[0].slots[0].content == Fingerprint((1, 2), (10, 20))
    clock[0] += 0.002  # a newer stamp, to the millisecond
    await one.publish(0, 0, Fingerprint((1, 2, 4), (10, 20, 30)), 30)
    await two.refresh()
    assert store.sent[-1] == 1
    assert fleet.backends[0].slots[0].content == Fingerprint((1, 2, 4), (10, 20, 30))


async def test_replicas_whose_clocks_differ_read_each_others_records(redis_server: Any) -> None:
    """Slot records are stamped by Redis's clock. Stamped by each writer's, a record written
    by a replica whose clock runs 30 s behind, after one written by a replica 30 s ahead,
    read as older than the one it replaced: the replica ahead skipped it (the slot's new
    content) until its own clock caught up, and aged the slot's last use by 60 s."""
    from prometheus_client import CollectorRegistry

    from proxy.core.prompt.fingerprint import Fingerprint
    from proxy.core.server.fleet import Fleet, SlotState
    from proxy.metrics import ProxyMetrics
    from proxy.replicas.shared_state import SharedState
    from proxy.state.redis import RedisStateStore

    replicas = []
    for skew in (30.0, -30.0):
        fleet = Fleet(["b"])
        fleet.backends[0].slots = [SlotState(0)]
        store = RedisStateStore(redis_server.url)
        wall = lambda skew=skew: time.time() + skew  # noqa: E731
        shared = SharedState(store, fleet, ProxyMetrics(CollectorRegistry()), wall, enabled=True)
        replicas.append((fleet, shared, store))
    (ahead_fleet, ahead, _), (behind_fleet, behind, _) = replicas
    try:
        await ahead.publish(0, 0, Fingerprint((1, 2), (10, 20)), 20)
        await behind.refresh()
        assert behind_fleet.backends[0].slots[0].content == Fingerprint((1, 2), (10, 20))
        await behind.publish(0, 0, Fingerprint((3,), (5,)), 5)
        await ahead.refresh()
        slot = ahead_fleet.backends[0].slots[0]
        assert slot.content == Fingerprint((3,), (5,))
        assert slot.last_used > time.monotonic() - 1.0
    finally:
        for _, _, store in replicas:
            await store.close()


async def test_a_replica_models_the_ram_cache_of_slots_another_replica_replaced(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """Replica B's request replaces session X's content on the one slot; llama-server parks
    X in its RAM cache. Replica A learns of it only from B's slot record, and must model the
    park as if it had placed the request itself: X's next turn through A is predicted to load
    it (before, A forgot X and predicted a cold prompt, so it could route X elsewhere)."""
    backend = await fakes(n_slots=1)
    a = await proxy([backend], redis_url=redis_server.url, replica_url="off")
    b = await proxy([backend], redis_url=redis_server.url, replica_url="off")
    x = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x " * 200}]
    y = [{"role": "system", "content": "other " * 150}, {"role": "user", "content": "y " * 200}]
    first = await (await a.post("/v1/chat/completions", json=chat_of(x))).json()
    assert (await b.post("/v1/chat/completions", json=chat_of(y))).status == 200
    x += [first["choices"][0]["message"], {"role": "user", "content": "more " * 20}]
    resp = await a.post("/v1/chat/completions", json=chat_of(x))
    body = await resp.json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 300  # loaded from RAM
    predicted = int(resp.headers["X-Cache-Predicted-Tokens"])
    assert predicted > 300, (resp.headers["X-Cache-Route"], predicted)


def chat_of(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": 4}

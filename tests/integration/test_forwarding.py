"""Each backend's requests are scheduled by one replica (``core.replicas.homes``,
``proxy.http.forwarding``): two replicas sharing one real Redis in front of fake llama-servers."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from typing import Any

import pytest

from proxy.core.prompt.headers import FORWARDED_BY
from proxy.core.replicas.auth import request_parts, sign_forward
from testbed.probes import metric, until_listed
from testbed.stack import free_port
from tests.conftest import REPLICA_SECRET, delta_text, events_to_done
from tests.integration.test_routing_fake import SYSTEM
from tests.waiting import until_down

FORWARDS = "llama_cache_proxy_forwarded_requests_total"
CHAT = "/v1/chat/completions"


async def _metrics(client: Any) -> str:
    return str(await (await client.get("/metrics")).text())


async def _met(*clients: Any) -> None:
    await until_listed([str(c.make_url("")).rstrip("/") for c in clients])


def _from_replica(
    body: dict[str, Any],
    request_id: str,
    *,
    secret: str = REPLICA_SECRET,
    sent: float | None = None,
) -> dict[str, Any]:
    """Keyword arguments of a POST to /v1/chat/completions as a replica forwards it: its
    mark signed with ``secret`` at ``sent`` (default: now) for this very request."""
    data = json.dumps(body).encode()
    parts = request_parts(request_id, "POST", "/v1/chat/completions", data)
    mark = sign_forward(secret.encode(), "another", time.time() if sent is None else sent, parts)
    headers = {FORWARDED_BY: mark, "X-Request-Id": request_id, "Content-Type": "application/json"}
    return {"data": data, "headers": headers}


def _turn(session: int, history: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    if not history:
        history.append({"role": "system", "content": SYSTEM})
    history.append({"role": "user", "content": f"session {session}: " + "go on " * 20})
    return {"messages": list(history), "max_tokens": 6, **extra}


@pytest.mark.parametrize("skew", [0.0, 2.0])
async def test_each_backends_requests_are_scheduled_by_one_replica(
    fakes: Any, proxy: Any, redis_server: Any, skew: float
) -> None:
    """Four sessions on 2 backends x 2 slots, each turn through the other replica (half of
    them streamed): every response of a backend comes from the same replica, its home;
    requests that arrived elsewhere were forwarded there, and each session keeps its slot.
    Also when one replica's clock runs ``skew`` seconds ahead: Redis judges liveness."""
    backends = [await fakes(n_slots=2) for _ in range(2)]
    walls = [time.time, lambda: time.time() + skew]
    pair = [await proxy(backends, redis_url=redis_server.url, wall=w) for w in walls]
    await _met(*pair)
    histories: dict[int, list[dict[str, Any]]] = defaultdict(list)
    scheduled: dict[str, set[str]] = defaultdict(set)
    slots: dict[int, set[tuple[str, str]]] = defaultdict(set)
    prompts = 0
    for turn in range(3):
        for session in range(4):
            stream = (session + turn) % 2 == 1
            body = _turn(session, histories[session], stream=stream)
            resp = await pair[(session + turn) % 2].post("/v1/chat/completions", json=body)
            assert resp.status == 200, await resp.text()
            if stream:
                events = await events_to_done(resp)
                reply = delta_text(events)
                timings = next(e["timings"] for e in events if e.get("timings"))
            else:
                data = await resp.json()
                reply, timings = data["choices"][0]["message"]["content"], data["timings"]
            prompts += timings["prompt_n"] + timings["cache_n"]
            assert reply
            histories[session].append({"role": "assistant", "content": reply})
            backend = resp.headers["X-Cache-Backend"]
            scheduled[backend].add(resp.headers["X-Cache-Replica"])
            slots[session].add((backend, resp.headers["X-Cache-Slot"]))
    assert len(scheduled) == 2
    assert all(len(r) == 1 for r in scheduled.values()), scheduled
    assert len(set.union(*scheduled.values())) == 2  # each replica is one backend's home
    assert all(len(s) == 1 for s in slots.values()), slots
    texts = [await _metrics(c) for c in pair]
    sent = [metric(t, FORWARDS, outcome="sent") for t in texts]
    received = [metric(t, FORWARDS, outcome="received") for t in texts]
    assert sum(sent) > 0
    assert sent == received[::-1], (sent, received)
    # usage is counted once, by the replica that scheduled the request
    assert sum(metric(t, "llama_cache_proxy_prompt_tokens_total") for t in texts) == prompts
    assert [metric(t, "llama_cache_proxy_replicas_live") for t in texts] == [2, 2]


async def test_a_home_that_cannot_be_reached_is_skipped_and_the_request_routed_here(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """Replica b advertises a URL nothing listens on: a request a would forward to it is
    routed by a instead (200), and a does not try again for ``RETRY_SECONDS``."""
    backends = [await fakes(n_slots=2) for _ in range(2)]
    a = await proxy(backends, redis_url=redis_server.url)
    nowhere = f"http://127.0.0.1:{free_port()}"
    b = await proxy(backends, redis_url=redis_server.url, replica_url=nowhere)
    await _met(a, b)
    seen = set()
    for session in range(4):
        resp = await a.post("/v1/chat/completions", json=_turn(session, []))
        assert resp.status == 200, await resp.text()
        seen.add(resp.headers["X-Cache-Backend"])
    assert len(seen) == 2  # one of them is b's home
    text = await _metrics(a)
    assert metric(text, FORWARDS, outcome="unreachable") == 1
    assert metric(text, FORWARDS, outcome="sent") == 0


async def test_replicas_advertising_one_url_do_not_forward(
    fakes: Any, proxy: Any, redis_server: Any, caplog: Any
) -> None:
    """Both replicas configured with one ``replica_url`` (as if every replica were given the
    load balancer's address): neither is anyone's home, so neither forwards; each routes what
    reaches it over every backend, and says why. Before, each forwarded half its requests to
    that address (here nothing listens there: counted unreachable)."""
    backends = [await fakes(n_slots=2) for _ in range(2)]
    shared = f"http://127.0.0.1:{free_port()}"
    pair = [await proxy(backends, redis_url=redis_server.url, replica_url=shared) for _ in "ab"]
    await _met(*pair)
    histories: dict[int, list[dict[str, Any]]] = defaultdict(list)
    seen = set()
    for turn in range(2):  # each session's second turn reaches the other replica
        for session in range(4):
            body = _turn(session, histories[session])
            resp = await pair[(session + turn) % 2].post("/v1/chat/completions", json=body)
            assert resp.status == 200, await resp.text()
            seen.add(resp.headers["X-Cache-Backend"])
            reply = (await resp.json())["choices"][0]["message"]["content"]
            histories[session].append({"role": "assistant", "content": reply})
    assert len(seen) == 2
    for text in [await _metrics(c) for c in pair]:
        assert metric(text, FORWARDS, outcome="unreachable") == 0
        assert metric(text, FORWARDS, outcome="sent") == 0
    assert f"all advertise {shared}" in caplog.text


async def test_a_forwarded_request_is_routed_where_it_lands(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    backends = [await fakes(n_slots=2) for _ in range(2)]
    pair = [await proxy(backends, redis_url=redis_server.url) for _ in range(2)]
    await _met(*pair)
    replicas, served = set(), set()
    for session in range(4):
        forwarded = _from_replica(_turn(session, []), f"r{session}")
        resp = await pair[0].post("/v1/chat/completions", **forwarded)
        assert resp.status == 200
        replicas.add(resp.headers["X-Cache-Replica"])
        served.add(resp.headers["X-Cache-Backend"])
    assert len(replicas) == 1
    assert len(served) == 1  # its own backend: the other one's requests go to its home
    text = await _metrics(pair[0])
    assert metric(text, FORWARDS, outcome="received") == 4
    assert metric(text, FORWARDS, outcome="sent") == 0
    received = [h for fake in backends for path, _, h in fake.received if "chat" in path]
    assert len(received) == 4
    assert all("X-Cache-Forwarded-By" not in headers for headers in received)  # between replicas


async def test_a_replica_whose_own_backends_are_down_places_on_the_others(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """A replica places requests only on the backends it schedules, unless none of them is
    up: then it serves from the others rather than fail."""
    backends = [await fakes(n_slots=2) for _ in range(2)]
    pair = [await proxy(backends, redis_url=redis_server.url) for _ in range(2)]
    await _met(*pair)
    first = await pair[0].post("/v1/chat/completions", **_from_replica(_turn(0, []), "r0"))
    own = first.headers["X-Cache-Backend"]
    gone = next(b for b in backends if b.url.endswith(own))
    await gone.stop()
    await until_down(pair[0], gone)  # the prober saw it go
    resp = await pair[0].post("/v1/chat/completions", **_from_replica(_turn(1, []), "r1"))
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Cache-Backend"] != own


async def test_a_burst_of_new_sessions_is_spread_over_every_replicas_backends(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """Four new sessions at once, two through each replica: each replica works out its
    requests' targets from one read of the shared view, in which every slot is empty, so the
    choices tie. A tie goes to a backend this replica schedules (no hop): each replica keeps
    its two. Before, every target was the lowest backend index: one replica's backend took
    all four, two of them waiting for its slots while the other backend sat idle."""
    backends = [await fakes(n_slots=2, gen_s_per_token=0.05) for _ in range(2)]
    pair = [await proxy(backends, redis_url=redis_server.url) for _ in range(2)]
    await _met(*pair)

    async def send(session: int) -> Any:
        body = _turn(session, [], max_tokens=4)
        resp = await pair[session % 2].post("/v1/chat/completions", json=body)
        assert resp.status == 200, await resp.text()
        return resp.headers

    found = await asyncio.gather(*(send(s) for s in range(4)))
    per_backend: defaultdict[str, int] = defaultdict(int)
    for headers in found:
        per_backend[headers["X-Cache-Backend"]] += 1
        assert "wait" not in headers["X-Cache-Route"], headers["X-Cache-Route"]
    assert sorted(per_backend.values()) == [2, 2], dict(per_backend)


async def test_a_forwarded_request_keeps_its_query_string_and_its_mark_covers_it(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """Requests with a query string, each turn through the other replica: every backend
    sees the query as the client sent it, relayed ones too (the relay sent the path alone),
    and every mark verifies. A mark signed for the path alone is refused with a query added
    (it signed the path alone, so a captured mark passed with any query)."""
    backends = [await fakes(n_slots=2) for _ in range(2)]
    pair = [await proxy(backends, redis_url=redis_server.url) for _ in range(2)]
    await _met(*pair)
    query = "trace=%C3%A9%20x&y=1"
    histories: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for turn in range(2):
        for session in range(4):
            body = _turn(session, histories[session])
            resp = await pair[(session + turn) % 2].post(f"{CHAT}?{query}", json=body)
            assert resp.status == 200, await resp.text()
            histories[session].append({"role": "assistant", "content": "ok"})
    chats = [q for fake in backends for path, q in fake.queries if path == CHAT]
    assert chats == [query] * 8
    texts = [await _metrics(c) for c in pair]
    assert sum(metric(t, FORWARDS, outcome="sent") for t in texts) > 0
    assert sum(metric(t, FORWARDS, outcome="rejected") for t in texts) == 0
    forwarded = _from_replica(_turn(9, []), "r9")
    resp = await pair[0].post(f"{CHAT}?y=2", **forwarded)
    assert resp.status == 200, await resp.text()
    assert metric(await _metrics(pair[0]), FORWARDS, outcome="rejected") == 1


async def test_an_anthropic_stream_cut_between_replicas_ends_with_anthropics_error_event(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """A ``/v1/messages`` stream forwarded to its backend's home, whose answer stops coming
    (the home waits on its backend longer than this replica waits on the home): the client
    gets Anthropic's ``error`` event, which its SDK raises, not OpenAI's shape, which it
    skips (it then returned a cut message as if whole)."""
    backends = [await fakes(n_slots=2) for _ in range(2)]
    home = await proxy(backends, redis_url=redis_server.url, timeouts={"read_seconds": 30})
    other = await proxy(backends, redis_url=redis_server.url, timeouts={"read_seconds": 0.5})
    await _met(home, other)
    messages = [{"role": "user", "content": "conversation 0: " + "go on " * 40}]
    body = {"model": "m", "max_tokens": 8, "system": SYSTEM, "messages": messages}
    first = await home.post("/v1/messages", json=body)  # placed on a backend of its own
    assert first.status == 200, await first.text()
    served = next(b for b in backends if b.url.endswith(first.headers["X-Cache-Backend"]))
    served.drop_next(after_chunks=2, stall=True)
    messages += [
        {"role": "assistant", "content": (await first.json())["content"][0]["text"]},
        {"role": "user", "content": "and then?"},
    ]
    resp = await other.post("/v1/messages", json={**body, "messages": messages, "stream": True})
    assert resp.status == 200
    events = [e for e in (await resp.text()).split("\n\n") if e.strip()]
    assert metric(await _metrics(other), FORWARDS, outcome="sent") == 1
    assert events[0].startswith("event: message_start\n")
    name, data = events[-1].split("\n")
    assert name == "event: error"
    assert json.loads(data.removeprefix("data: "))["error"]["type"] == "timeout_error"


async def test_a_request_its_home_queues_past_the_read_timeout_is_relayed(
    fakes: Any, proxy: Any, redis_server: Any
) -> None:
    """The home queues a forwarded request for a slot (up to ``queue.max_wait_seconds``)
    before its backend answers: the relaying replica waits for the answer's headers that
    long and then the read timeout, not the read timeout alone (a 504 while the home still
    had the request queued). A session's slot is busy with a long answer on the home; its
    next prompt reaches the other replica, which forwards it to wait there."""
    backends = [await fakes(n_slots=1, gen_s_per_token=0.1) for _ in range(2)]
    options = {"timeouts": {"read_seconds": 0.4}, "queue": {"max_wait_seconds": 10.0}}
    pair = [await proxy(backends, redis_url=redis_server.url, **options) for _ in "ab"]
    await _met(*pair)
    history = [{"role": "system", "content": "Rule: keep it small. " * 400}]
    history.append({"role": "user", "content": "agent 0: begin"})
    first = await pair[0].post(CHAT, json={"messages": history, "max_tokens": 2, "stream": True})
    assert first.status == 200
    reply = delta_text(await events_to_done(first))
    home, relay = pair  # a new session is placed where it arrives (a tie goes to its own)
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "next"}]
    # a long answer for the session on the home (6 tokens of 0.1 s)...
    busy = await home.post(CHAT, json={"messages": history, "max_tokens": 6, "stream": True})
    assert busy.status == 200
    # ... while its next prompt reaches the other replica, which forwards it to wait there
    later = [*history, {"role": "assistant", "content": "x"}, {"role": "user", "content": "go"}]
    second = await relay.post(CHAT, json={"messages": later, "max_tokens": 2, "stream": True})
    assert second.status == 200, await second.text()
    assert delta_text(await events_to_done(second))
    await busy.read()
    assert metric(await _metrics(relay), FORWARDS, outcome="sent") == 1

"""The fake llama-server answers like the real one where the proxy depends on it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from proxy.core.server.ram_cache import PRIMER
from testbed.fake_llama import FakeLlamaServer

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6
QUICK = aiohttp.ClientTimeout(total=0.1)  # a client that gives up before the answer


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def _observations(url: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    _, lru = await _post(url + "/completion", {"prompt": "Hello.", "n_predict": 1})
    seen["unpinned_on_a_fresh_server_takes_slot"] = lru["id_slot"]  # the last of equals
    base = {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "id_slot": 0}
    _, first = await _post(url + "/completion", base)
    _, again = await _post(url + "/completion", base)
    prompt = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
    seen["cold_cache_n"] = first["timings"]["cache_n"]
    seen["repeat_reuses_all_but_one"] = again["timings"]["cache_n"] == prompt - 1
    seen["kv_is_prompt_plus_reply_minus_one"] = again["tokens_cached"] == prompt + 4 - 1
    _, off = await _post(url + "/completion", {**base, "cache_prompt": False})
    seen["cache_prompt_false"] = off["timings"]["cache_n"]
    _, zero = await _post(url + "/completion", {**base, "n_predict": 0, "id_slot": 1})
    seen["n_predict_0_tokens"] = zero["tokens_predicted"]
    status, _ = await _post(url + "/completion", {**base, "n": 3})
    seen["n_over_slots_status"] = status
    _, wrapped = await _post(url + "/completion", {**base, "id_slot": 3})
    seen["id_slot_wraps_to"] = wrapped["id_slot"]
    other = {
        "prompt": "Completely unrelated text about tides and moons. " * 12,
        "n_predict": 4,
        "temperature": 0,
        "id_slot": 0,
    }
    await _post(url + "/completion", other)  # slot 0: A's tokens go to the RAM cache
    _, back = await _post(url + "/completion", base)  # f_keep < 0.5: A loaded from RAM
    seen["ram_cache_restores_parked_prompt"] = back["timings"]["cache_n"] >= prompt - 1
    seen["ram_cache_scans_oldest_first"] = await _older_entry_shadows_newer(url)
    seen["ram_load_moves_entry_out"] = await _loaded_entry_leaves_the_cache(url)
    seen["primer_loads_a_parked_session"] = await _primer_loads_a_parked_session(url)
    seen["a_tenth_shared_runs_the_hook"] = await _a_tenth_shared_runs_the_hook(url)
    async with aiohttp.ClientSession() as session, session.get(url + "/slots") as resp:
        slots = await resp.json()
    seen["slots_fields"] = all({"id", "n_ctx", "is_processing"} <= s.keys() for s in slots)
    seen["slot_count"] = len(slots)
    async with aiohttp.ClientSession() as session, session.get(url + "/props") as resp:
        seen["total_slots"] = (await resp.json())["total_slots"]
    seen["stream_timings_on"] = await _stream_timings(url)
    seen["origins_allowed"] = await _origins_allowed(url)
    return seen


async def _origins_allowed(url: str) -> list[str | None]:
    """The CORS origin each answer allows: a health check's, an error's and a preflight's
    to a browser's origin, and a health check's without one."""
    app = {"Origin": "http://app.example"}
    asks = [("GET", "/health", app), ("GET", "/nope", app), ("OPTIONS", "/completion", app)]
    allowed = []
    async with aiohttp.ClientSession() as session:
        for method, path, headers in [*asks, ("GET", "/health", {})]:
            async with session.request(method, url + path, headers=headers) as resp:
                allowed.append(resp.headers.get("Access-Control-Allow-Origin"))
    return allowed


async def _stream_timings(url: str) -> dict[str, list[str]]:
    """Which chunks of a streamed chat carry the server's ``timings``: the finishing one, or
    with ``stream_options.include_usage`` the usage chunk after it alone (no choice)."""
    out = {}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    usage = {"stream_options": {"include_usage": True}}
    for name, extra in (("plain", {}), ("include_usage", usage)):
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/chat/completions", json={**body, **extra}) as resp,
        ):
            text = await resp.text()
        kinds = []
        for event in text.split("\n\n"):
            payload = event.removeprefix("data: ").strip()
            data = json.loads(payload) if payload.startswith("{") else None
            if data and "timings" in data:
                choices = data.get("choices") or [{}]
                kinds.append("finish" if choices[0].get("finish_reason") else "usage")
        out[name] = kinds
    return out


async def _older_entry_shadows_newer(url: str) -> bool:
    """The RAM cache takes an entry only when it beats the best so far in both kept share
    and similarity, scanning oldest first: an older entry keeping more of itself shadows a
    newer one that shares more with the prompt (server-task.cpp, prompt cache ``load``)."""
    shared = "Shadow test sentence about rivers and their deltas. " * 5
    more = "Quartz quietly queues quarterly quotes. " * 3
    older = shared + "Alpha beta gamma delta epsilon. " * 2
    newer = shared + more + "Long filler about mountains and valleys. " * 10

    def body(prompt: str, slot: int) -> dict[str, Any]:
        return {"prompt": prompt, "n_predict": 2, "temperature": 0, "id_slot": slot}

    await _post(url + "/completion", body(older, 0))
    await _post(url + "/completion", body("Unrelated words about clouds. " * 4, 1))  # parks older
    await _post(url + "/completion", body(newer, 0))
    await _post(url + "/completion", body("Other unrelated words about tides. " * 9, 0))
    _, query = await _post(url + "/completion", body(shared + more + "End.", 0))
    _, tokens = await _post(url + "/tokenize", {"content": shared + more})
    return bool(query["timings"]["cache_n"] < len(tokens["tokens"]) - 3)


async def _loaded_entry_leaves_the_cache(url: str) -> bool:
    """A request that shares only a header with a parked session loads that session's entry
    (it keeps a quarter of itself) and overwrites its tail: the entry has left the cache, so
    the session coming back gets only the header (server-task.cpp, prompt cache ``load``)."""
    header = "Shared header about harbors and lighthouses. " * 4
    session = header + "Alpha session notes about gardens. " * 8

    def body(prompt: str) -> dict[str, Any]:
        return {"prompt": prompt, "n_predict": 2, "temperature": 0, "id_slot": 1}

    await _post(url + "/completion", body(session))
    await _post(url + "/completion", body("Unrelated words about deserts. " * 12))  # parks it
    await _post(url + "/completion", body(header + "Other tail on bridges and rivers. " * 8))
    _, back = await _post(url + "/completion", body(session))
    _, tokens = await _post(url + "/tokenize", {"content": session})
    return bool(back["timings"]["cache_n"] < len(tokens["tokens"]) / 2)


async def _primer_loads_a_parked_session(url: str) -> tuple[bool, bool]:
    """A session parked in RAM (an idle slot saved as another task starts) does not come back
    into a slot holding another session under the same long header: the request keeps over
    half of it, so the hook does not run, and only the header is reused. After a primer
    (``ram_cache.PRIMER``, ``n_predict: 0``) in that slot, it comes back whole."""
    header = "Long shared header about ports, ships and their cargo manifests. " * 12
    session = header + "Session alpha asks about cranes."
    other = header + "Session beta asks about tugs."
    unrelated = {"prompt": "Unrelated words about deserts. " * 4, "n_predict": 2, "id_slot": 0}

    def body(prompt: str) -> dict[str, Any]:
        return {"prompt": prompt, "n_predict": 2, "temperature": 0, "id_slot": 1}

    _, tokens = await _post(url + "/tokenize", {"content": session})
    whole = len(tokens["tokens"])
    found = []
    for primed in (False, True):
        await _post(url + "/completion", body(session))
        await _post(url + "/completion", unrelated)  # a task starts: the idle slot 1 is saved
        await _post(url + "/completion", body(other))  # keeps over half: no hook
        if primed:
            primer = {"prompt": PRIMER, "n_predict": 0, "id_slot": 1}
            await _post(url + "/completion", primer)
        _, back = await _post(url + "/completion", body(session))
        found.append(back["timings"]["cache_n"] >= whole - 1)
    return found[0], found[1]


async def _a_tenth_shared_runs_the_hook(url: str) -> bool:
    """A pinned slot that shares no more than a tenth of the prompt (the server's
    ``--slot-prompt-similarity``) runs the hook even when the prompt keeps over half of the
    slot: its ``f_keep`` counts as 0. The slot holds a short prompt (B) under a short start
    also opening a long one (A), parked in RAM; A's continuation keeps 0.6 of B but shares
    0.05 of itself with it, and A comes back from RAM."""
    start = "Start of the shared part. " * 4
    first = start + "Alpha notes on gardens and paths. " * 30
    short = start + "Beta tail words here. " * 2
    longer = first + "More notes about rivers and lakes. " * 30

    def body(prompt: str) -> dict[str, Any]:
        return {"prompt": prompt, "n_predict": 2, "temperature": 0, "id_slot": 1}

    await _post(url + "/completion", body(first))
    await _post(url + "/completion", body(short))  # keeps under half of A: A goes to RAM
    _, back = await _post(url + "/completion", body(longer))
    _, tokens = await _post(url + "/tokenize", {"content": first})
    return bool(back["timings"]["cache_n"] >= len(tokens["tokens"]) - 1)


async def _same_on_both(
    observe: Callable[[str], Awaitable[dict[str, Any]]], real_url: str, fake: FakeLlamaServer
) -> dict[str, Any]:
    """The real server's observations, once the fake has made the same ones."""
    await fake.start()
    try:
        expected = await observe(real_url)
        assert await observe(fake.url) == expected
    finally:
        await fake.stop()
    return expected


async def test_fake_matches_real_server(llama_servers: Any) -> None:
    real = llama_servers(slots=2)
    expected = await _same_on_both(_observations, real.url, FakeLlamaServer(n_slots=2))
    assert expected["repeat_reuses_all_but_one"] is True
    assert expected["cache_prompt_false"] == 0
    assert expected["n_over_slots_status"] == 400
    assert expected["id_slot_wraps_to"] == 1
    assert expected["ram_cache_restores_parked_prompt"] is True
    assert expected["ram_cache_scans_oldest_first"] is True
    assert expected["ram_load_moves_entry_out"] is True
    assert expected["primer_loads_a_parked_session"] == (False, True)
    assert expected["a_tenth_shared_runs_the_hook"] is True
    assert expected["unpinned_on_a_fresh_server_takes_slot"] == 1
    assert expected["stream_timings_on"] == {"plain": ["finish"], "include_usage": ["usage"]}


async def _ram_budget_observations(url: str) -> dict[str, bool]:
    """With room for one parked prompt (``--cache-ram 1``: 1 MiB, about 45 tokens of this
    model's KV), a parked prompt comes back, and parking a second one evicts the first."""

    def text(word: str) -> str:
        return f"Budget {word} words about orchards and their tall trees. " * 3

    def body(prompt: str, slot: int | None) -> dict[str, Any]:
        pinned = {"id_slot": slot} if slot is not None else {}
        return {"prompt": prompt, "n_predict": 2, "temperature": 0, **pinned}

    async def cached(prompt: str) -> bool:  # unpinned: the LRU slot, through the RAM cache
        _, reply = await _post(url + "/completion", body(prompt, None))
        _, tokens = await _post(url + "/tokenize", {"content": prompt})
        return bool(reply["timings"]["cache_n"] > len(tokens["tokens"]) / 2)

    seen = {}
    for word in ("alpha", "beta"):
        await _post(url + "/completion", body(text(word), 1))
    seen["one_parked_prompt_comes_back"] = await cached(text("alpha"))
    for word in ("gamma", "delta", "epsilon"):
        await _post(url + "/completion", body(text(word), 1))
    seen["second_parked_prompt_evicts_the_first"] = not await cached(text("gamma"))
    return seen


async def test_fake_ram_budget_matches_real_server(llama_servers: Any) -> None:
    real = llama_servers(slots=2, extra=("--cache-ram", "1"))
    fake = FakeLlamaServer(n_slots=2, ram_tokens=40)  # one 29-word entry fits, two do not
    expected = await _same_on_both(_ram_budget_observations, real.url, fake)
    assert expected == {
        "one_parked_prompt_comes_back": True,
        "second_parked_prompt_evicts_the_first": True,
    }


async def _idle_save_observations(url: str) -> dict[str, bool]:
    """Room for two parked prompts (``--cache-ram 2``): slot 0 holds X while slot 1 runs
    alpha, beta, gamma, then beta again. Each take of slot 1 parks what it held; with
    ``--cache-idle-slots`` every task also saves idle slot 0's X, which pushes the parked
    prompts out (beta is gone by its return); without, the cache holds only what slots
    gave up, and beta comes back."""

    def text(word: str) -> str:
        return f"Budget {word} words about orchards and their tall trees. " * 3

    def body(word: str, slot: int) -> dict[str, Any]:
        return {"prompt": text(word), "n_predict": 2, "temperature": 0, "id_slot": slot}

    await _post(url + "/completion", body("xi", 0))
    for word in ("alpha", "beta", "gamma"):
        await _post(url + "/completion", body(word, 1))
    _, back = await _post(url + "/completion", body("beta", 1))
    _, tokens = await _post(url + "/tokenize", {"content": text("beta")})
    return {"parked_prompt_comes_back": back["timings"]["cache_n"] > len(tokens["tokens"]) / 2}


@pytest.mark.parametrize("idle_saves", [True, False])
async def test_fake_idle_slot_saves_match_real_server(llama_servers: Any, idle_saves: bool) -> None:
    flags = ("--cache-ram", "2") + (() if idle_saves else ("--no-cache-idle-slots",))
    real = llama_servers(slots=2, extra=flags)
    fake = FakeLlamaServer(n_slots=2, ram_tokens=80, cache_idle_slots=idle_saves)
    expected = await _same_on_both(_idle_save_observations, real.url, fake)
    assert expected == {"parked_prompt_comes_back": not idle_saves}


async def _slot_file_observations(url: str, other_layout_url: str) -> dict[str, Any]:
    """Save / restore / refusal behaviour (reference §5), as the disk tier depends on it."""
    seen: dict[str, Any] = {}
    _, lru = await _post(url + "/completion", {"prompt": "Hello.", "n_predict": 1})
    seen["unpinned_on_a_fresh_server_takes_slot"] = lru["id_slot"]  # the last of equals
    base = {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "id_slot": 0}
    _, first = await _post(url + "/completion", base)
    kv = first["tokens_cached"]
    _, saved = await _post(url + "/slots/0?action=save", {"filename": "parity.bin"})
    seen["save_fields"] = sorted(saved)
    seen["saved_is_the_kv"] = saved["n_saved"] == kv
    status, _ = await _post(url + "/slots/0?action=save", {"filename": "../x.bin"})
    seen["bad_name_status"] = status
    _, restored = await _post(url + "/slots/1?action=restore", {"filename": "parity.bin"})
    seen["restore_fields"] = sorted(restored)
    seen["restored_all"] = restored["n_restored"] == kv
    _, after = await _post(url + "/completion", {**base, "id_slot": 1})
    seen["cross_slot_restore_reused"] = after["timings"]["cache_n"] == kv - 4  # prompt - 1
    status, _ = await _post(url + "/slots/1?action=restore", {"filename": "missing.bin"})
    seen["missing_file_status"] = status
    async with aiohttp.ClientSession() as session, session.get(url + "/slots") as resp:
        seen["failed_restore_wipes"] = (await resp.json())[1]["n_prompt_tokens"] == 0
    status, _ = await _post(
        other_layout_url + "/slots/0?action=restore", {"filename": "parity.bin"}
    )
    seen["other_np_status"] = status
    return seen


async def test_fake_slot_files_match_real_server(llama_servers: Any) -> None:
    real = llama_servers(slots=2)
    real3 = llama_servers(slots=3, save_dir=real.save_dir)
    fake = FakeLlamaServer(n_slots=2, save_dir=real.save_dir / "fake")
    fake3 = FakeLlamaServer(n_slots=3, save_dir=real.save_dir / "fake")
    fake.save_dir.mkdir()  # type: ignore[union-attr]
    await fake.start()
    await fake3.start()
    try:
        expected = await _slot_file_observations(real.url, real3.url)
        assert await _slot_file_observations(fake.url, fake3.url) == expected
    finally:
        await fake.stop()
        await fake3.stop()
    assert expected["saved_is_the_kv"] is True
    assert expected["restored_all"] is True
    assert expected["other_np_status"] == 400
    assert expected["failed_restore_wipes"] is True
    assert expected["cross_slot_restore_reused"] is True


async def _left_then_polled(
    session: aiohttp.ClientSession, url: str, n_predict: int, polls: int, until_idle: bool
) -> list[bool]:
    """A client leaves a non-streamed request of ``n_predict`` tokens after 0.1 s; then
    ``/slots`` is read every 0.25 s, ``polls`` times (``until_idle``: until the slot is idle):
    whether the slot was processing at each read."""
    body = {"prompt": "I believe the meaning of life is", "n_predict": n_predict}
    with pytest.raises(TimeoutError):
        await session.post(url + "/completion", json={**body, "ignore_eos": True}, timeout=QUICK)
    busy: list[bool] = []
    for _ in range(polls):
        async with session.get(url + "/slots") as resp:
            busy.append((await resp.json())[0]["is_processing"])
        if until_idle and not busy[-1]:
            break
        await asyncio.sleep(0.25)
    return busy


async def _disconnect_observations(url: str) -> dict[str, bool]:
    """The server checks a waiting request's socket only after a second with no task
    result, so the slot of a long generation stays busy while ``/slots`` is read (each answer
    is a result), and is freed once it has had a quiet second."""
    seen = {}
    async with aiohttp.ClientSession() as session:
        busy = await _left_then_polled(session, url, 2000, 10, until_idle=False)  # 2.5 s
        seen["busy_while_slots_are_read"] = all(busy)
        await asyncio.sleep(1.6)
        async with session.get(url + "/slots") as resp:
            seen["idle_after_a_quiet_second"] = not (await resp.json())[0]["is_processing"]
    return seen


async def _generated_observations(url: str) -> dict[str, bool]:
    """While ``/slots`` is read no quiet second comes, but a task of 24 tokens ends when it
    has generated its reply, and the slot is freed then (polled for up to 30 s: a busy
    machine is slow)."""
    async with aiohttp.ClientSession() as session:
        busy = await _left_then_polled(session, url, 24, 120, until_idle=True)
    return {"busy_at_first": busy[0], "idle_once_generated_while_slots_are_read": not busy[-1]}


async def test_fake_checks_a_waiting_clients_socket_as_the_real_server(llama_servers: Any) -> None:
    real = llama_servers(slots=1)
    fake = FakeLlamaServer(n_slots=1, gen_s_per_token=0.05, disconnect_poll_s=1.0)
    expected = await _same_on_both(_disconnect_observations, real.url, fake)
    assert expected == {"busy_while_slots_are_read": True, "idle_after_a_quiet_second": True}
    fake = FakeLlamaServer(n_slots=1, gen_s_per_token=0.05, disconnect_poll_s=1.0)
    expected = await _same_on_both(_generated_observations, real.url, fake)
    assert expected == {"busy_at_first": True, "idle_once_generated_while_slots_are_read": True}

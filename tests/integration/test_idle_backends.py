"""Idle backends: a server that sleeps (``--sleep-idle-seconds``) is let sleep, and what its
sleep and unified KV's idle-slot clearing destroy is not counted on."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.waiting import until

LONG = (
    "Once upon a time in a land far away, there lived a brave knight who traveled across "
    "mountains and rivers to find the legendary golden sword hidden deep within the enchanted "
    "forest of whispers. He met many creatures along the way including dragons and fairies."
)


async def _sleeping(client: Any) -> bool:
    return bool((await (await client.get("/props")).json())["is_sleeping"])


async def test_an_idle_backend_is_let_sleep_and_its_caches_are_forgotten(
    fakes: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake = await fakes()
    fake.sleep_idle_s = 0.5
    caplog.set_level(logging.INFO, "proxy.backends.health")
    client = await proxy([fake], health={"interval_seconds": 0.1})
    body = {"prompt": LONG, "n_predict": 4, "cache_prompt": True}
    assert (await client.post("/completion", json=body)).status == 200
    # probes every 0.1 s must not keep it awake
    await until(lambda: _sleeping(client), "the backend sleeps despite the probes", within=5)
    gone = "sleeping: its slot and RAM caches are gone"  # the proxy has seen it sleep
    await until(lambda: gone in caplog.text, "the proxy sees the backend sleep")
    resp = await client.post("/completion", json=body)
    assert (await resp.json())["timings"]["cache_n"] == 0  # its context was destroyed
    assert resp.headers["X-Cache-Predicted-Tokens"] == "0"  # and the proxy knew it
    assert not await _sleeping(client)


async def test_each_sleep_is_seen_after_a_request_woke_the_backend(
    fakes: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A request wakes a sleeping backend; when it sleeps again, that is seen too (it went
    unseen once the proxy had marked the backend asleep: every later prediction counted on a
    context the sleep had destroyed)."""
    fake = await fakes()
    fake.sleep_idle_s = 0.05  # asleep again well before the next probe
    caplog.set_level(logging.INFO, "proxy.backends.health")
    client = await proxy([fake], health={"interval_seconds": 0.3})
    body = {"prompt": LONG, "n_predict": 4, "cache_prompt": True}
    gone = "sleeping: its slot and RAM caches are gone"
    assert (await client.post("/completion", json=body)).status == 200
    for sleeps in (1, 2, 3):

        def seen(n: int = sleeps) -> bool:
            return caplog.text.count(gone) >= n

        await until(seen, f"sleep {sleeps} seen", within=5)
        resp = await client.post("/completion", json=body)  # wakes it
        assert (await resp.json())["timings"]["cache_n"] == 0
        assert resp.headers["X-Cache-Predicted-Tokens"] == "0"


async def test_with_unified_kv_a_continuation_goes_where_its_prefix_is(
    fakes: Any, proxy: Any
) -> None:
    """llama.cpp's test_clear_and_restore, sent back to back: each task start saves the idle
    slots to the RAM cache and clears them, so the first prompt's slot is empty after the
    second request; the continuation goes to the slot that loaded it back from RAM."""
    fake = await fakes(n_slots=2, unified=True)
    client = await proxy([{"url": fake.url, "kv_unified": True}], health={"interval_seconds": 60})
    for prompt in (LONG, "The quick brown fox", LONG):
        body = {"prompt": prompt, "n_predict": 4, "cache_prompt": True}
        assert (await client.post("/completion", json=body)).status == 200
    body = {"prompt": LONG + " The knight finally reached the castle gates.", "n_predict": 4}
    answer = await (await client.post("/completion", json=body)).json()
    assert answer["timings"]["cache_n"] > 0, answer["id_slot"]


async def test_the_backend_tokenizer_never_wakes_a_sleeping_backend(
    fakes: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``routing.tokenizer: backend`` counts with a ready backend's ``/tokenize``; a sleeping
    one's would wake it (a task) and wait out its model load, for a request that may run
    elsewhere. Another awake backend counts instead; with none, tiktoken does."""
    sleeper, awake = await fakes(), await fakes()
    sleeper.sleep_idle_s = 0.2
    caplog.set_level(logging.INFO, "proxy.backends.health")
    client = await proxy(
        [sleeper, awake], routing={"tokenizer": "backend"}, health={"interval_seconds": 0.1}
    )
    gone = "sleeping: its slot and RAM caches are gone"
    await until(lambda: gone in caplog.text, "the proxy sees the first backend sleep", within=5)
    before = sleeper.tokenize_calls
    body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    assert sleeper.tokenize_calls == before
    assert awake.tokenize_calls > 0

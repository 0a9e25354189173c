"""The fake llama-server answers like the real one where the proxy depends on it."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.fake_llama import FakeLlamaServer

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def _observations(url: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
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
    async with aiohttp.ClientSession() as session, session.get(url + "/slots") as resp:
        slots = await resp.json()
    seen["slots_fields"] = all({"id", "n_ctx", "is_processing"} <= s.keys() for s in slots)
    seen["slot_count"] = len(slots)
    async with aiohttp.ClientSession() as session, session.get(url + "/props") as resp:
        seen["total_slots"] = (await resp.json())["total_slots"]
    return seen


async def test_fake_matches_real_server(llama_servers: Any) -> None:
    real = llama_servers(slots=2)
    fake = FakeLlamaServer(n_slots=2)
    await fake.start()
    try:
        expected = await _observations(real.url)
        assert await _observations(fake.url) == expected
    finally:
        await fake.stop()
    assert expected["repeat_reuses_all_but_one"] is True
    assert expected["cache_prompt_false"] == 0
    assert expected["n_over_slots_status"] == 400
    assert expected["id_slot_wraps_to"] == 1
    assert expected["ram_cache_restores_parked_prompt"] is True

"""A batch ``prompt`` (one server task per element) never pins a busy slot."""

from __future__ import annotations

import json
from typing import Any

import pytest

from testbed.fake_llama import FakeLlamaServer
from testbed.probes import metric

LONG = "The quick brown fox jumps over the lazy dog. " * 4
BATCHES = [
    [LONG + "first", LONG + "second", LONG + "third"],
    [[LONG + "first"], "second"],
]


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


@pytest.mark.parametrize("prompt", BATCHES, ids=["strings", "nested"])
@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
async def test_a_batch_runs_unpinned_on_a_backend_of_its_own(
    fakes: Any, proxy: Any, path: str, prompt: list[Any]
) -> None:
    fake: FakeLlamaServer = await fakes(n_slots=4, gen_s_per_token=0.002)
    client = await proxy([fake])
    body = {"prompt": prompt, "max_tokens": 6, "n_predict": 6}
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    data = await resp.json()
    results = data if path == "/completion" else data["choices"]
    assert [r["index"] for r in results] == list(range(len(prompt)))
    sent = fake.received[-1][1]
    assert "id_slot" not in sent
    assert sent["prompt"] == prompt
    assert fake.violations == []


async def test_a_streamed_batch_relays_every_element(fakes: Any, proxy: Any) -> None:
    fake: FakeLlamaServer = await fakes(n_slots=2, gen_s_per_token=0.002)
    client = await proxy([fake])
    body = {"prompt": [LONG + "a", LONG + "b"], "n_predict": 5, "stream": True}
    resp = await client.post("/completion", json=body)
    assert resp.status == 200
    events = _events(await resp.text())
    for index in (0, 1):
        words = [e["content"] for e in events if e["index"] == index and not e.get("stop")]
        assert len(words) == 5
    assert "id_slot" not in fake.received[-1][1]
    assert fake.violations == []


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
async def test_a_streamed_batch_counts_every_elements_tokens(
    fakes: Any, proxy: Any, path: str
) -> None:
    """Each element ends with its own final chunk and usage, as the real server streams a
    batch (``tests/real/test_real_batches.py``): the proxy counts every one of them."""
    fake: FakeLlamaServer = await fakes(n_slots=2, gen_s_per_token=0.002)
    client = await proxy([fake])
    body = {"prompt": [LONG + "a", LONG + "bb cc"], "n_predict": 3, "max_tokens": 3}
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status == 200
    finals = [e["timings"] for e in _events(await resp.text()) if "timings" in e]
    assert len(finals) == 2
    page = await (await client.get("/metrics")).text()
    counted = metric(page, "llama_cache_proxy_prompt_tokens_total")
    assert counted == sum(t["prompt_n"] + t["cache_n"] for t in finals) > 0


async def test_token_ids_and_a_single_element_stay_pinned(fakes: Any, proxy: Any) -> None:
    fake: FakeLlamaServer = await fakes(n_slots=2)
    client = await proxy([fake])
    for prompt in ([11, 12, 13, 14], ["only one " * 20], ["text", 12, 13]):
        resp = await client.post("/completion", json={"prompt": prompt, "n_predict": 3})
        assert resp.status == 200, await resp.text()
        assert isinstance(fake.received[-1][1]["id_slot"], int)
    assert fake.violations == []


async def test_the_fake_pins_every_element_to_the_requests_slot(fakes: Any) -> None:
    """As llama-server does: each element's task gets the request's id_slot, so the second
    one is pinned to the slot the first is running on (the proxy must never send this)."""
    import aiohttp

    fake: FakeLlamaServer = await fakes(n_slots=2, gen_s_per_token=0.002)
    body = {"prompt": [LONG + "a", LONG + "b"], "n_predict": 4, "id_slot": 0}
    async with (
        aiohttp.ClientSession() as session,
        session.post(fake.url + "/completion", json=body) as resp,
    ):
        assert resp.status == 200
        results = await resp.json()
    assert [r["id_slot"] for r in results] == [0, 0]  # as the real server (test_real_batches)
    assert len(fake.violations) == 1


async def test_a_prompt_object_is_served_pinned_as_its_text(fakes: Any, proxy: Any) -> None:
    """``{"prompt_string": ...}`` is one prompt (llama-server's multimodal form): served and
    routed by its text; with ``multimodal_data`` on a text model, the server's own 400."""
    fake: FakeLlamaServer = await fakes(n_slots=2)
    client = await proxy([fake])
    body = {"prompt": {"prompt_string": LONG + "object"}, "n_predict": 3}
    for _ in range(2):
        resp = await client.post("/completion", json=body)
        assert resp.status == 200, await resp.text()
        assert isinstance(fake.received[-1][1]["id_slot"], int)
    assert (await resp.json())["timings"]["cache_n"] > 30  # routed back to its slot
    media = {"prompt": {"prompt_string": "x", "multimodal_data": ["aGk="]}, "n_predict": 3}
    resp = await client.post("/completion", json=media)
    assert resp.status == 400
    assert "multimodal" in (await resp.json())["error"]["message"].lower()

"""``/metrics`` serves the proxy's own metrics, then each backend's llama-server metrics: one
backend's verbatim, several labelled by backend; a backend without ``--metrics`` adds none."""

from __future__ import annotations

from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from testbed.probes import metric
from tests.conftest import chat


def _families(page: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(page)}


async def test_one_backend_metrics_follow_the_proxys_own_verbatim(fakes: Any, proxy: Any) -> None:
    fake = await fakes()
    fake.metrics, fake.api_key = True, "backend-key"
    client = await proxy([{"url": fake.url, "api_key": "backend-key"}])
    key = {"Authorization": "Bearer backend-key"}  # the proxy checks its backends' keys
    body = chat("hello there")
    assert (await client.post("/v1/chat/completions", json=body, headers=key)).status == 200
    resp = await client.get("/metrics", headers=key)
    page = await resp.text()
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=")
    assert resp.headers["Process-Start-Time-Unix"] == str(fake.started_at)
    start = page.index("# HELP llamacpp:")
    assert "llama_cache_proxy_prompt_tokens_total" in page[:start]
    assert page[start:] == await _direct(fake.url + "/metrics", "backend-key")
    assert fake.tokens_processed > 0
    assert metric(page, "llamacpp:prompt_tokens_total") == fake.tokens_processed
    assert _families(page)["llamacpp:prompt_tokens"].type == "counter"


async def _direct(url: str, key: str) -> str:
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        return await resp.text()


async def test_several_backends_labelled_and_one_without_metrics_adds_nothing(
    fakes: Any, proxy: Any
) -> None:
    a, b, off = await fakes(), await fakes(), await fakes()
    a.metrics = b.metrics = True
    a.tokens_processed, b.tokens_processed = 5, 8
    client = await proxy(
        [{"url": fake.url, "name": name} for fake, name in ((a, "a"), (off, "off"), (b, "b"))]
    )
    resp = await client.get("/metrics")
    page = await resp.text()
    assert resp.status == 200
    assert page.count("# TYPE llamacpp:prompt_tokens_total counter") == 1
    assert page.count("# HELP llamacpp:requests_processing ") == 1
    assert metric(page, "llamacpp:prompt_tokens_total", backend="a") == 5
    assert metric(page, "llamacpp:prompt_tokens_total", backend="b") == 8
    assert 'backend="off"' not in page.partition("llamacpp:")[2]
    samples = _families(page)["llamacpp:prompt_tokens"].samples
    assert [s.labels for s in samples] == [{"backend": "a"}, {"backend": "b"}]
    assert resp.headers["Process-Start-Time-Unix"] == str(a.started_at)


async def test_no_backend_metrics_leaves_the_proxys_own(fakes: Any, proxy: Any) -> None:
    off = await fakes()  # llama-server's default: no --metrics, /metrics answers 501
    client = await proxy([off])
    resp = await client.get("/metrics")
    page = await resp.text()
    assert resp.status == 200
    assert "llama_cache_proxy_requests_in_flight" in page
    assert "llamacpp:" not in page
    assert "Process-Start-Time-Unix" not in resp.headers

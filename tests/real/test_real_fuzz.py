"""The fuzz suite's hostile requests against the real llama-server behind the proxy.

The same generators as ``tests/integration/test_fuzz.py`` (malformed JSON, wrong types,
huge strings, deep nesting, invalid UTF-8, out-of-range ``id_slot``, ``n`` over the slots,
batch prompts, unknown paths) on every POST route and every GET route: never a 5xx of the
proxy's own, never a traceback; afterwards the server has no slot left processing, the
proxy's slots are idle, and it still serves a completion.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given

from proxy.upstream import ROUTES
from testbed.probes import metric
from testbed.stack import LlamaServer, require_real_stack
from tests.integration.test_fuzz import FUZZED, Served, _check, fuzz_once, paths, raw


@pytest.fixture(scope="module")
def served_real() -> Iterator[Served]:
    binary, model = require_real_stack()
    # -n bounds every generation (fuzzed token limits reach 2**31), as an operator would
    server = LlamaServer(binary, model, slots=2, extra=("-n", "8")).start()
    proxy = Served(
        server.save_dir,  # the disk tier on: the server's --slot-save-path
        backend=server.url,
        max_body_bytes=64 * 1024,
        timeouts={"read_seconds": 120},
    )
    yield proxy
    proxy.stop()
    server.cleanup()


@FUZZED
@given(path=paths, body=raw)
def test_fuzzed_requests_on_the_real_server(served_real: Served, path: str, body: bytes) -> None:
    fuzz_once(served_real, path, body)


@pytest.mark.parametrize("path", [p for p, r in ROUTES.items() if r.method == "GET"])
def test_get_routes_on_the_real_server(served_real: Served, path: str) -> None:
    status, headers, payload = served_real.request("GET", path + "?x=%00%ff", None)
    _check(status, headers, payload)
    disabled = path in ("/tools", "/cors-proxy")  # (the server runs without those features)
    router_only = path == "/models/sse"  # the server's 404 outside router mode, relayed
    assert status == (403 if disabled else 404 if router_only else 200), payload[:200]


def test_afterwards_nothing_is_left_running_and_it_still_serves(served_real: Served) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "still there?"}]}).encode()
    status, _, payload = served_real.request("POST", "/v1/chat/completions", body)
    assert status == 200, payload[:300]
    assert json.loads(payload)["choices"][0]["message"]["content"]
    assert served_real.backend is not None
    deadline = time.monotonic() + 30  # an aborted task ends at the server's next poll (1 s)
    while True:
        with urllib.request.urlopen(served_real.backend + "/slots", timeout=5) as resp:
            processing = [s["id"] for s in json.load(resp) if s["is_processing"]]
        _, _, page = served_real.request("GET", "/metrics", None)
        in_flight = metric(page.decode(), "llama_cache_proxy_requests_in_flight")
        if (not processing and in_flight == 1) or time.monotonic() > deadline:  # 1: this scrape
            break
        time.sleep(0.2)
    assert processing == []
    assert in_flight == 1


def test_the_save_dir_holds_only_the_proxys_files(served_real: Served) -> None:
    names = {p.name for p in Path(served_real.save_dir).iterdir()} - {"server.log"}
    assert all(name.startswith("llp-") for name in names)

"""The access log: one line per request that a client cannot forge, its JSON form, the real
outcome of a broken stream, and which routing headers a client sees."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import aiohttp
import pytest

from proxy.http.middleware import SAFE_ID, JsonLogFormatter
from tests.conftest import chat
from tests.waiting import until


def access(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "proxy.access"]


FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^ "]+)(?: |$)')


def parsed(line: str) -> dict[str, str]:
    """A ``key=value`` access line as a reader parses it (quoted values are JSON strings)."""
    pairs = FIELD.findall(line)
    assert "".join(f"{k}={v} " for k, v in pairs).strip() == line  # nothing else in it
    return {k: json.loads(v) if v.startswith('"') else v for k, v in pairs}


async def test_a_newline_in_the_path_or_spaces_in_the_request_id_forge_no_line(
    fakes: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client = await proxy([await fakes()])
    forged = "x status=200 path=/v1/chat/completions"
    with caplog.at_level(logging.INFO, logger="proxy.access"):
        resp = await client.get("/healthz%0arequest_id=forged%20status=200")
        assert resp.status == 404
        ok = await client.post("/v1/chat/completions", json=chat("hi", max_tokens=2),
                               headers={"X-Request-Id": forged})  # fmt: skip
    assert ok.status == 200
    given = ok.headers["X-Request-Id"]
    assert given != forged
    assert SAFE_ID.fullmatch(given)
    lines = [r.getMessage() for r in access(caplog)]
    assert len(lines) == 2
    first, second = (parsed(line) for line in lines)
    assert (first["path"], first["status"]) == ("/healthz\nrequest_id=forged status=200", "404")
    assert second["request_id"] == given
    assert list(first) == list(second)


async def test_a_plain_client_request_id_is_kept(fakes: Any, proxy: Any) -> None:
    client = await proxy([await fakes()])
    resp = await client.post("/v1/chat/completions", json=chat("hi", max_tokens=2),
                             headers={"X-Request-Id": "trace-42.a:b"})  # fmt: skip
    assert resp.headers["X-Request-Id"] == "trace-42.a:b"


async def test_json_log_lines_carry_the_access_fields(
    fakes: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client = await proxy([await fakes()])
    with caplog.at_level(logging.INFO, logger="proxy.access"):
        assert (await client.get("/nothing%0ahere")).status == 404
    (record,) = access(caplog)
    line = JsonLogFormatter().format(record)
    assert "\n" not in line
    fields = json.loads(line)
    assert fields["path"] == "/nothing\nhere"
    assert (fields["status"], fields["outcome"], fields["logger"]) == (
        404,
        "complete",
        "proxy.access",
    )
    assert fields["slot"] is None


async def test_a_stream_the_backend_breaks_is_logged_as_an_upstream_error(
    fakes: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake = await fakes(n_slots=1)
    client = await proxy([fake])
    fake.drop_next(after_chunks=2)
    with caplog.at_level(logging.INFO, logger="proxy.access"):
        resp = await client.post("/v1/chat/completions", json=chat("x", stream=True))
        assert resp.status == 200  # the status line was sent before the backend failed
        await resp.text()
    (line,) = [r.getMessage() for r in access(caplog)]
    assert " status=200 outcome=upstream_error " in line


async def test_a_client_that_leaves_mid_stream_is_logged_as_gone(
    fakes: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake = await fakes(n_slots=1, gen_s_per_token=0.05, abort_release_s=0.1)
    client = await proxy([fake])
    url = str(client.make_url("/v1/chat/completions"))
    with caplog.at_level(logging.INFO, logger="proxy.access"):
        async with aiohttp.ClientSession() as session:
            resp = await session.post(url, json=chat("x", stream=True, max_tokens=60))
            await resp.content.readany()
            resp.close()
        await until(lambda: bool(access(caplog)), "the request is logged")
    (line,) = [r.getMessage() for r in access(caplog)]
    assert " status=499 outcome=client_gone " in line


@pytest.mark.parametrize("shown", [False, True], ids=["default", "opt-in"])
async def test_internal_addresses_are_shown_only_when_asked(
    fakes: Any, proxy: Any, redis_server: Any, shown: bool
) -> None:
    fake = await fakes()
    routing = {"address_headers": shown}
    client = await proxy([fake], redis_url=redis_server.url, routing=routing)
    resp = await client.post("/v1/chat/completions", json=chat("hi", max_tokens=2))
    assert resp.status == 200
    assert "X-Cache-Route" in resp.headers
    assert "X-Cache-Slot" in resp.headers
    assert ("X-Cache-Backend" in resp.headers) is shown
    assert ("X-Cache-Replica" in resp.headers) is shown
    if shown:
        assert resp.headers["X-Cache-Backend"] == fake.url.removeprefix("http://")

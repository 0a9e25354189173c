"""The access log and response headers over a real llama-server: a stream the server breaks
is logged as an upstream error (the client already got its 200), internal addresses stay
hidden by default, and a header that is not UTF-8 is a 400."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from tests.integration.test_access_log import access, parsed
from tests.integration.test_hostile_headers import raw_request


async def test_a_stream_the_real_server_breaks_is_logged_as_an_upstream_error(
    llama_servers: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = llama_servers(slots=1)
    client = await proxy([server.url], routing={"address_headers": False})
    body = {
        "messages": [{"role": "user", "content": "Count from 1 to 400, separated by commas."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    raw = json.dumps({**body, "stream": False, "max_tokens": 2}).encode()
    status, answer = await raw_request(
        client, "POST", "/v1/chat/completions", b"X-Session-Id: \xff\xfe", raw
    )
    assert status == 400
    assert json.loads(answer)["error"]["code"] == "invalid_header"
    with caplog.at_level(logging.INFO, logger="proxy.access"):
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200
        assert "X-Cache-Route" in resp.headers
        assert "X-Cache-Backend" not in resp.headers
        lines = []
        async for line in resp.content:
            lines.append(line)
            if len(lines) == 10:
                server.stop()  # SIGKILL mid-stream
    events = [json.loads(x[6:]) for x in lines if x.startswith(b"data: {")]
    assert "error" in events[-1]
    fields = parsed(access(caplog)[-1].getMessage())
    assert (fields["status"], fields["outcome"]) == ("200", "upstream_error")

"""A backend's event stream relayed to the client (``proxy.http.streaming.relay``), as the
backend's bytes arrive in pieces."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiohttp import web

from proxy.config.sections import TimeoutSettings
from proxy.core.prompt.usage import SseScanner
from proxy.http.middleware import RECORD, RequestRecord
from proxy.http.streaming import Outcome, relay
from proxy.upstream import LlamaServerClient
from testbed.stack import free_port

LAST = {
    "choices": [{"delta": {}, "finish_reason": "stop"}],
    "timings": {"prompt_n": 3, "cache_n": 7, "predicted_n": 2},
}


def stream(eol: bytes) -> bytes:
    first = {"choices": [{"delta": {"content": "h\u00e9llo"}, "finish_reason": None}]}
    events = b"".join(b"data: " + json.dumps(e).encode() + eol * 2 for e in (first, LAST))
    return events + b"data: [DONE]" + eol * 2


async def relayed(pieces: list[bytes], aiohttp_client: Any) -> tuple[bytes, Outcome]:
    """The client's bytes and the relay's outcome when the backend sends ``pieces`` as
    separate chunks of a chunked body, a few milliseconds apart."""

    served: list[asyncio.Task[Any]] = []

    async def backend(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(asyncio.current_task())  # type: ignore[arg-type]
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.005)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()  # (until the proxy closes)
        writer.close()
        await writer.wait_closed()

    port = free_port()
    listening = await asyncio.start_server(backend, "127.0.0.1", port)
    client = LlamaServerClient(None, TimeoutSettings(read_seconds=5))
    await client.open()
    outcomes: list[Outcome] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        request[RECORD] = RequestRecord("r", time.monotonic())
        url = f"http://127.0.0.1:{port}"
        async with client.send(url, "/", method="POST", body=b"{}", headers=[]) as upstream:
            outcome = await relay(request, upstream, {}, time.monotonic, outcomes.append)
        outcomes.append(outcome)
        return outcome.response

    app = web.Application()
    app.router.add_post("/", handler)
    proxy = await aiohttp_client(app)
    body = await (await proxy.post("/", data=b"{}")).read()
    await client.close()
    await asyncio.gather(*served)
    listening.close()
    await listening.wait_closed()
    return body, outcomes[-1]


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("cut", ["bytes", "after-done-line"])
async def test_a_stream_cut_anywhere_is_relayed_byte_for_byte_with_its_end(
    eol: bytes, cut: str, aiohttp_client: Any
) -> None:
    """Byte by byte (cuts inside ``data:``, a UTF-8 character and a line end), or right
    after the end event's line, its blank line still to come: the client gets every byte,
    the blank line that dispatches ``[DONE]`` included, and usage and reply are read."""
    body = stream(eol)
    if cut == "bytes":
        pieces = [body[i : i + 1] for i in range(len(body))]
    else:
        end = body.index(b"[DONE]") + len(b"[DONE]") + len(eol)
        pieces = [body[:end], body[end:]]
    got, outcome = await relayed(pieces, aiohttp_client)
    assert got == body
    assert outcome.complete
    assert outcome.usage is not None
    assert (outcome.usage.prompt_tokens, outcome.usage.cached_tokens) == (10, 7)
    assert outcome.reply is not None
    assert outcome.reply.content == "h\u00e9llo"


async def test_a_fault_reading_the_answer_ends_the_stream_with_one_error_event(
    aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever fails in the proxy while it reads a stream it is relaying (here the scanner,
    on the second piece): the client has had the status line, so it gets the bytes so far,
    one error event and a well-formed end of the body; no second status line lands in the
    chunked body (an exception that left the relay made the middleware write one)."""
    feed = SseScanner.feed
    calls: list[bytes] = []

    def failing(self: SseScanner, chunk: bytes) -> bytes:
        calls.append(chunk)
        if len(calls) == 2:
            raise RuntimeError("a fault of the proxy's own")
        return feed(self, chunk)

    monkeypatch.setattr(SseScanner, "feed", failing)
    body = stream(b"\n")
    first_event = body.index(b"\n\n") + 2
    got, outcome = await relayed([body[:first_event], body[first_event:]], aiohttp_client)
    assert got.startswith(body[:first_event])
    error = json.loads(got[first_event:].removeprefix(b"data: "))["error"]
    assert error["code"] == "bad_gateway"
    assert "could not relay" in error["message"]
    assert not outcome.complete

"""Relay a backend response to the client, byte for byte, as it arrives.

SSE and other chunked bodies are written to the client chunk by chunk (no buffering), while
``SseScanner`` reads usage from the same bytes. Non-streamed bodies are read whole, which is
how they arrive anyway, and usage is read from the JSON.

Mid-stream policy: the status line is already sent, so an upstream failure after the first
byte cannot change it. The proxy then writes one SSE event ``data: {"error": {...}}`` in
OpenAI's error shape and ends the stream; the client sees a closed stream, never a hang;
the access log says ``outcome=upstream_error``.
A client that goes away makes the write fail (or cancels the handler); the upstream
connection is then closed so llama-server cancels the generation.

``Outcome.complete`` is true only when the upstream body was read to its end, or to its end
event (``data: [DONE]`` and the blank line that dispatches it, sent after the server released
the slot): the caller frees the slot at once then, and otherwise lets it drain.

A client that has its whole reply may close the connection at once (OpenClaw does, at
``[DONE]``), which cancels the handler (``handler_cancellation``). Once the stream's final event
(the one with usage) has been relayed the response counts as complete: a cancellation then, or
a reset while ending the chunked body, does not undo it (the server releases the slot before it
sends that event). ``to_the_end`` runs the caller's bookkeeping after a complete response
(freeing the slot, recording what it holds) through such a cancellation.

``before_eof`` (the caller's bookkeeping after a complete stream: giving the slot's lease
back, registering the release, writing its record) is awaited before the client gets the end
event and the end of the chunked body (``SseScanner`` holds them back), so a client that sends
its next turn as soon as it reads ``[DONE]``, perhaps to another replica, finds the slot free
and recorded.

``anthropic``: the upstream answer is a chat completion sent for an Anthropic Messages request;
the client gets it translated (``core.request.anthropic_reply``), while usage and reply are read
from the chat completion as for any other.

``on_usage`` (the caller's metrics) runs once per response, as soon as its usage is known and
before the bytes that carry it reach the client: a client that reads ``/metrics`` right after
its stream ends finds its own request counted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import aiohttp
from aiohttp import web

from proxy.core.prompt.headers import client_response_headers
from proxy.core.prompt.usage import Reply, SseScanner, Usage, read_body
from proxy.core.request.anthropic_reply import StreamReply, reply_body, sse_error
from proxy.errors import sse_error_event
from proxy.http.middleware import RECORD, Ending
from proxy.upstream import translate_stream_error
from proxy.upstream_http import Response, UpstreamBroken


@dataclass
class Outcome:
    response: web.StreamResponse
    usage: Usage | None = None
    reply: Reply | None = None
    complete: bool = False
    first_byte_at: float | None = None


def _is_stream(upstream: Response) -> bool:
    return upstream.content_type == "text/event-stream"


async def relay(
    request: web.Request,
    upstream: Response,
    extra_headers: dict[str, str],
    clock: Callable[[], float],
    on_usage: Callable[[Outcome], None],
    before_eof: Callable[[Outcome], Awaitable[None]] | None = None,
    anthropic: bool = False,
) -> Outcome:
    headers = client_response_headers(upstream.headers.items())
    if not _is_stream(upstream):
        body = await upstream.read()
        sent = reply_body(upstream.status, body) if anthropic else body
        response = web.Response(status=upstream.status, body=sent, headers=headers)
        response.headers.update(extra_headers)
        if anthropic:
            response.content_type = "application/json"
        usage, reply = read_body(body) if upstream.status == 200 else (None, None)
        outcome = Outcome(response, usage, reply, complete=True)
        on_usage(outcome)
        return outcome
    translator = StreamReply() if anthropic else None
    return await _relay_stream(
        request, upstream, headers, extra_headers, clock, on_usage, before_eof, translator
    )


async def _relay_stream(
    request: web.Request,
    upstream: Response,
    headers: list[tuple[str, str]],
    extra_headers: dict[str, str],
    clock: Callable[[], float],
    on_usage: Callable[[Outcome], None],
    before_eof: Callable[[Outcome], Awaitable[None]] | None = None,
    translator: StreamReply | None = None,
) -> Outcome:
    response = web.StreamResponse(status=upstream.status, headers=headers)
    response.headers.update(extra_headers)
    outcome = Outcome(response)
    scanner = SseScanner()
    recorded = False
    await response.prepare(request)
    try:
        async for chunk in upstream.chunks():
            if outcome.first_byte_at is None:
                outcome.first_byte_at = clock()
            ready = scanner.feed(chunk)
            if scanner.usage is not None and not recorded:
                recorded = True  # the chunk that ends the stream carries it: count it first
                on_usage(replace(outcome, usage=scanner.usage))
            if ready and translator is not None:
                ready = translator.lines(ready)
            if ready:
                await response.write(ready)
            if scanner.ended:
                break  # the end event: the server has released the slot; nothing follows
    # (the backend failing, or the client: a write to a client that left fails too)
    except (UpstreamBroken, aiohttp.ClientConnectionError, TimeoutError) as exc:
        if request.transport is None or request.transport.is_closing():
            if recorded:
                return _completed(outcome, scanner)  # the client left with its whole reply
            raise  # the client left: nothing to tell it
        if not recorded:
            on_usage(outcome)
        request[RECORD].outcome = Ending.UPSTREAM_ERROR  # logged: the status line said 200
        error = translate_stream_error(exc)
        if translator is not None:
            await response.write(sse_error(error.status, error.message))
        else:
            await response.write(sse_error_event(error))
        await response.write_eof()
        return outcome
    except asyncio.CancelledError:
        if not recorded:
            raise  # the client left before its reply ended: the generation is cancelled
        _uncancel()
        return _completed(outcome, scanner)
    tail = scanner.close()
    if translator is not None:
        tail = translator.end(tail)
    outcome = _completed(outcome, scanner)
    if not recorded:
        on_usage(outcome)
    if before_eof is not None:
        await before_eof(outcome)
    # the client may close after the last byte of the reply, before the chunk terminator
    with contextlib.suppress(ConnectionResetError):
        if tail:
            await response.write(tail)
        await response.write_eof()
    return outcome


def _completed(outcome: Outcome, scanner: SseScanner) -> Outcome:
    scanner.close()  # idempotent: a caller whose client is still there forwarded what it held
    outcome.usage, outcome.reply = scanner.usage, scanner.reply
    outcome.complete = True
    return outcome


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


T = TypeVar("T")


async def to_the_end(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even if the client leaves (cancelling the handler) meanwhile."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if task.done():
            raise
        _uncancel()
        return await task

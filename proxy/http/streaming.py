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

``anthropic``: the client asked in Anthropic's Messages API, so a failure mid-stream is told
as Anthropic's ``error`` event; ``translate`` (by default the same): the upstream answer is the
chat completion sent for it, and the client gets it translated (``core.request.anthropic_reply``)
while usage and reply are read from the chat completion as for any other. A replica relaying
another replica's answer (``http.forwarding``) gets it translated already.

A fault while reading the answer (the proxy's own: nothing the server sends may raise, but a
fault must not leave the stream open or put a second status line into it) is logged with its
traceback and ends the stream with the same error event, as ``Ending.PROXY_ERROR``.

``on_usage`` (the caller's metrics) runs once per response, as soon as its usage is known and
before the bytes that carry it reach the client: a client that reads ``/metrics`` right after
its stream ends finds its own request counted. A request of several server tasks (``tasks``: a
batch ``prompt``, or ``n`` choices) has its usage known once every task's final chunk is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import aiohttp
from aiohttp import web

from proxy.core.prompt.headers import client_response_headers
from proxy.core.prompt.usage import Reply, SseScanner, Usage, read_body
from proxy.core.request.anthropic_reply import StreamReply, reply_body, sse_error
from proxy.errors import BadGateway, ProxyError, ServiceUnavailable, sse_error_event
from proxy.http.middleware import RECORD, Ending
from proxy.upstream import BackendLoading, loading_answer, translate_stream_error
from proxy.upstream_http import Response, UpstreamBroken

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    response: web.StreamResponse
    usage: Usage | None = None
    reply: Reply | None = None
    complete: bool = False
    first_byte_at: float | None = None
    failure: ProxyError | None = None  # the backend failed after the status line was sent


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
    translate: bool | None = None,
    tasks: int = 1,
) -> Outcome:
    headers = client_response_headers(upstream.headers.items())
    translate = anthropic if translate is None else translate
    if not _is_stream(upstream):
        body, status = await upstream.read(), upstream.status
        if loading_answer(status, body):  # (it restarted since it was probed)
            raise BackendLoading("the backend is loading its model")
        if translate:
            status, sent = reply_body(status, body)
        response = web.Response(status=status, body=sent if translate else body, headers=headers)
        response.headers.update(extra_headers)
        if translate:
            response.content_type = "application/json"
        usage, reply = read_body(body) if upstream.status == 200 else (None, None)
        outcome = Outcome(response, usage, reply, complete=True)
        on_usage(outcome)
        return outcome
    stream = _Stream(request, upstream, clock, anthropic, StreamReply() if translate else None)
    return await stream.relay(headers, extra_headers, on_usage, before_eof, tasks)


class _Stream:
    """One streamed answer being relayed (``relay``)."""

    def __init__(
        self,
        request: web.Request,
        upstream: Response,
        clock: Callable[[], float],
        anthropic: bool,
        translator: StreamReply | None,
    ) -> None:
        self._request, self._upstream, self._clock = request, upstream, clock
        self._anthropic, self._translator = anthropic, translator
        self._scanner = SseScanner()
        self.stopped = False

    def stop(self) -> None:
        """The proxy stops: end the answer now, with an error event saying so (its backend
        connection is closed, so the server cancels the task)."""
        self.stopped = True
        self._upstream.abort("the proxy is shutting down")

    async def relay(
        self,
        headers: list[tuple[str, str]],
        extra_headers: dict[str, str],
        on_usage: Callable[[Outcome], None],
        before_eof: Callable[[Outcome], Awaitable[None]] | None,
        tasks: int,
    ) -> Outcome:
        request, scanner, translator = self._request, self._scanner, self._translator
        response = web.StreamResponse(status=self._upstream.status, headers=headers)
        response.headers.update(extra_headers)
        outcome = Outcome(response)
        recorded = False
        await response.prepare(request)
        live = request.app.get(STREAMS, set())
        live.add(self)
        try:
            async for chunk in self._upstream.chunks():
                if outcome.first_byte_at is None:
                    outcome.first_byte_at = self._clock()
                ready = scanner.feed(chunk)
                if scanner.usage is not None and not recorded and scanner.finals >= tasks:
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
            if self.stopped:  # (``stop``: the proxy is stopping, the backend did not fail)
                stop = ServiceUnavailable("the proxy is shutting down", code="shutting_down")
                return await self._failed(outcome, recorded, on_usage, stop, Ending.SHUTDOWN)
            error = translate_stream_error(exc)
            return await self._failed(outcome, recorded, on_usage, error, Ending.UPSTREAM_ERROR)
        except asyncio.CancelledError:
            if not recorded:
                raise  # the client left before its reply ended: the generation is cancelled
            _uncancel()
            return _completed(outcome, scanner)
        except Exception:
            record = request[RECORD]
            log.exception("request_id=%s relaying the answer failed", record.request_id)
            error = BadGateway(
                f"the proxy could not relay the answer (request id {record.request_id})"
            )
            return await self._failed(outcome, recorded, on_usage, error, Ending.PROXY_ERROR)
        finally:
            live.discard(self)
        tail = scanner.close()
        if translator is not None:
            tail = translator.end(tail)
        outcome = _completed(outcome, scanner)
        try:
            if not recorded:
                on_usage(outcome)
            if before_eof is not None:
                await before_eof(outcome)
        except Exception:  # the caller's bookkeeping: the client still gets its whole reply
            log.exception("request_id=%s after the answer", request[RECORD].request_id)
        # the client may close after the last byte of the reply, before the chunk terminator
        with contextlib.suppress(ConnectionResetError):
            if tail:
                await response.write(tail)
            await response.write_eof()
        return outcome

    async def _failed(
        self,
        outcome: Outcome,
        recorded: bool,
        on_usage: Callable[[Outcome], None],
        error: ProxyError,
        ending: Ending,
    ) -> Outcome:
        """End a stream that failed after its status line: one error event in the client's
        API's shape, then the end of the body."""
        if not recorded:
            on_usage(outcome)
        self._request[RECORD].outcome = ending  # logged: the status line said 200
        if ending is Ending.UPSTREAM_ERROR:
            outcome.failure = error
        if self._anthropic:
            event = sse_error(error.status, error.message)
        else:
            event = sse_error_event(error)
        with contextlib.suppress(ConnectionResetError):
            await outcome.response.write(event)
            await outcome.response.write_eof()
        return outcome


# the answers streaming now: at shutdown each ends with an error event (``_Stream.stop``)
STREAMS: web.AppKey[set[_Stream]] = web.AppKey("streams")


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

"""A client's body on its way in: read within the limits, then parsed for its route.

Reading refuses what llama-server refuses before reading it (a ``Content-Encoding``: never
inflated, so no zip bomb; a ``Content-Length`` over ``max_body_bytes``) and bounds the
time the body may take to arrive. Parsing turns an Anthropic Messages body into the chat
completion it is served as, then validates it (``core.request.body``); the handler runs it
in a worker thread when the body is large (``proxy.offload``).
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from proxy.config.settings import Settings
from proxy.core.request.anthropic_request import chat_body
from proxy.core.request.body import ParsedBody, parse_body
from proxy.errors import PayloadTooLarge, RequestTimeout, UnreadableBody, UnsupportedEncoding
from proxy.upstream import Route, SlotUse


async def read_body(request: web.Request, settings: Settings) -> bytes:
    limit = settings.max_body_bytes
    if request.headers.get("Content-Encoding", "identity").strip().lower() != "identity":
        raise UnsupportedEncoding  # as llama-server; not decoded (app.py: auto_decompress)
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is over the {limit}-byte limit")
    try:
        if request.content.is_eof():  # it came whole with its head: nothing to wait for
            return await request.read()
        async with asyncio.timeout(settings.timeouts.client_body_seconds):
            return await request.read()
    except TimeoutError:
        raise RequestTimeout("the request body did not arrive in time") from None
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body is over the {limit}-byte limit") from None
    except RequestPayloadError:  # read no more of it (aiohttp would log that as unhandled)
        request.content.feed_eof()
        raise UnreadableBody from None


def parse_for(route: Route, raw: bytes) -> ParsedBody:
    """``raw`` validated for ``route`` (an Anthropic body: as the chat completion it becomes;
    the client's own bytes are what a replica forwards)."""
    sent = chat_body(raw) if route.via else raw
    generates = route.slot_use is SlotUse.PIN
    return parse_body(
        sent, chat=route.chat, prompt=route.prompt, batches=route.batches, generates=generates
    )

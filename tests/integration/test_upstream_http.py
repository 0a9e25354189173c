"""The request path's HTTP/1.1 client (``proxy.upstream_http``) against scripted servers.

Each server reads one request head (and its ``Content-Length`` body) at a time and answers
with the bytes a test gives, so framing, reuse and failure cases are exact."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from proxy.config.sections import TimeoutSettings
from proxy.upstream import LlamaServerClient, UpstreamConnectError
from proxy.upstream_http import (
    HIGH_WATER,
    IDLE_KEPT,
    IDLE_SECONDS,
    ConnectFailed,
    ConnectTimeout,
    Origin,
    Pool,
    Response,
    UpstreamBroken,
)
from testbed.stack import free_port
from tests.waiting import until

# a request's head -> the bytes to send (None: close at once; (bytes, "close"): close after)
Answer = Callable[[bytes], bytes | tuple[bytes, str] | None]


class Scripted:
    """A server answering each request with ``answer(head)``; counts connections and heads."""

    def __init__(self, answer: Answer, close_after: bool = False, reset: bool = False) -> None:
        self.answer, self.close_after, self.reset = answer, close_after, reset
        self.heads: list[bytes] = []
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":")[1]))
                out = self.answer(head)
                if out is None:
                    break
                close = isinstance(out, tuple)
                writer.write(out[0] if isinstance(out, tuple) else out)
                await writer.drain()
                if close:
                    break
                if self.reset:  # the connection reset after the answer's bytes (RST)
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                if self.close_after:  # (the end of a body framed by the connection's end)
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def scripted(
    answer: Answer, close_after: bool = False, reset: bool = False
) -> AsyncIterator[tuple[Scripted, str]]:
    server = Scripted(answer, close_after, reset)
    port = free_port()
    listening = await asyncio.start_server(server.serve, "127.0.0.1", port)
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        for writer in server.writers:
            writer.close()
        listening.close()
        await listening.wait_closed()


def ok(body: bytes = b'{"x": 1}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def exchange(
    pool: Pool, url: str, method: str = "POST", body: bytes | None = b"{}"
) -> tuple[int, bytes]:
    response = await pool.request(url, "/completion?x=1", method, body, [("X-A", "b")])
    data = await response.read()
    response.release()
    return response.status, data


async def test_a_request_goes_out_as_sent_and_its_connection_is_reused() -> None:
    async with scripted(lambda head: ok()) as (server, url):
        pool = Pool(5, 5)
        assert await exchange(pool, url) == (200, b'{"x": 1}')
        assert await exchange(pool, url) == (200, b'{"x": 1}')
        pool.close()
    assert server.connections == 1
    lines = server.heads[0].split(b"\r\n")
    assert lines[0] == b"POST /completion?x=1 HTTP/1.1"
    assert b"X-A: b" in lines
    assert b"Content-Length: 2" in lines
    assert any(line.startswith(b"Host: 127.0.0.1:") for line in lines)


async def test_a_burst_leaves_at_most_the_bound_of_idle_connections_open() -> None:
    """A burst of concurrent requests opens a connection each; after it, ``IDLE_KEPT`` stay
    open for reuse and the others are closed (they stayed listed, and open at the server)."""
    async with scripted(lambda head: ok()) as (server, url):
        pool = Pool(5, 5)
        burst = IDLE_KEPT + 20
        answers = await asyncio.gather(*(exchange(pool, url) for _ in range(burst)))
        assert answers == [(200, b'{"x": 1}')] * burst
        assert server.connections == burst
        idle = next(iter(pool._idle.values()))
        assert len(idle) == IDLE_KEPT
        pool.close()


async def test_a_chunked_body_with_extensions_and_trailers_is_read_whole() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: text/event-stream\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    async with scripted(lambda head: chunked) as (server, url):
        pool = Pool(5, 5)
        response = await pool.request(url, "/", "POST", b"{}", [])
        assert response.content_type == "text/event-stream"
        assert [c async for c in response.chunks()] in ([b"hello", b" world"], [b"hello world"])
        response.release()
        assert await exchange(pool, url) == (200, b"hello world")  # the connection reused
        pool.close()
    assert server.connections == 1


@pytest.mark.parametrize(
    ("answer", "method", "expected", "connections", "close_after"),
    [
        # a body without length runs to the connection's end: that connection is done
        (b"HTTP/1.1 200 OK\r\n\r\nuntil the end", "GET", (200, b"until the end"), 2, True),
        # a 204 followed by a chunked end is bodiless, and its connection dropped
        (b"HTTP/1.1 204 No Content\r\n\r\n0\r\n\r\n", "OPTIONS", (204, b""), 2, False),
        # an answer to HEAD has no body whatever its length says; its connection is reused
        (b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n", "HEAD", (200, b""), 1, False),
        # Connection: close is honoured
        (ok(extra=b"Connection: close\r\n"), "POST", (200, b'{"x": 1}'), 2, False),
        # a 101 does not return its connection (another protocol follows)
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "GET", (101, b""), 2, False),
    ],
    ids=["to-the-close", "204-chunked-end", "head", "connection-close", "101"],
)
async def test_framing_and_whether_a_connection_is_reused(
    answer: bytes,
    method: str,
    expected: tuple[int, bytes],
    connections: int,
    close_after: bool,
) -> None:
    """Two requests get the same answer, read as HTTP/1.1 frames it, over as many connections
    as the first answer leaves reusable (the server closes after a body to the close)."""
    body = b"{}" if method == "POST" else None
    async with scripted(lambda head: answer, close_after=close_after) as (server, url):
        pool = Pool(5, 5)
        for _ in range(2):
            assert await exchange(pool, url, method, body) == expected
        pool.close()
    assert server.connections == connections


async def test_an_interim_100_continue_is_skipped() -> None:
    async with scripted(lambda head: b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"done")) as (_, url):
        pool = Pool(5, 5)
        assert await exchange(pool, url) == (200, b"done")
        pool.close()


async def test_a_connection_idle_past_the_bound_is_not_reused() -> None:
    now = [0.0]
    async with scripted(lambda head: ok()) as (server, url):
        pool = Pool(5, 5, clock=lambda: now[0])
        await exchange(pool, url)
        now[0] += IDLE_SECONDS - 0.1
        await exchange(pool, url)
        assert server.connections == 1
        now[0] += IDLE_SECONDS + 0.1
        await exchange(pool, url)
        pool.close()
    assert server.connections == 2


async def test_a_refused_connect_is_connect_failed() -> None:
    pool = Pool(5, 5)
    with pytest.raises(ConnectFailed):
        await pool.request(f"http://127.0.0.1:{free_port()}", "/", "POST", b"{}", [])


async def test_silence_past_the_read_bound_is_a_timeout_and_drops_the_connection() -> None:
    async with scripted(lambda head: b"") as (server, url):
        pool = Pool(5, 0.2)
        with pytest.raises(TimeoutError):
            await pool.request(url, "/", "POST", b"{}", [])
        await until(server.writers[-1].is_closing, "the server sees the connection closed")


async def test_silence_mid_body_is_a_timeout() -> None:
    partial = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"
    async with scripted(lambda head: partial) as (_, url):
        pool = Pool(5, 0.2)
        response = await pool.request(url, "/", "POST", b"{}", [])
        with pytest.raises(TimeoutError):
            await response.read()
        response.close()


async def test_a_connection_lost_mid_body_is_broken() -> None:
    async with scripted(lambda head: b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc") as (
        server,
        url,
    ):
        pool = Pool(5, 5)
        response = await pool.request(url, "/", "POST", b"{}", [])
        server.writers[-1].close()
        with pytest.raises(UpstreamBroken):
            await response.read()


async def test_an_answer_that_is_not_http_is_broken() -> None:
    async with scripted(lambda head: b"SSH-2.0-OpenSSH\r\n\r\n") as (_, url):
        pool = Pool(5, 5)
        with pytest.raises(UpstreamBroken):
            await pool.request(url, "/", "POST", b"{}", [])


async def test_a_reused_connection_the_server_closed_is_retried_only_when_idempotent() -> None:
    served = 0

    def answer(head: bytes) -> bytes | None:
        nonlocal served
        served += 1
        return ok() if served % 2 else None  # every second request: the connection is closed

    async with scripted(answer) as (server, url):
        pool = Pool(5, 5)
        assert (await exchange(pool, url, "GET", None))[0] == 200
        assert (await exchange(pool, url, "GET", None))[0] == 200  # sent again on a new one
        assert server.connections == 2
        with pytest.raises(UpstreamBroken):
            await exchange(pool, url, "POST")  # a POST may have run: not sent again
        pool.close()


async def test_a_slow_reader_pauses_the_backend_and_gets_every_byte() -> None:
    size = 4 * HIGH_WATER
    big = b"x" * size
    async with scripted(lambda head: ok(big)) as (_, url):
        pool = Pool(5, 5)
        response = await pool.request(url, "/", "POST", b"{}", [])
        await asyncio.sleep(0.05)  # (lets the backend write ahead of the reader)
        assert response._buffered <= HIGH_WATER + 256 * 1024  # paused near the mark
        assert await response.read() == big
        response.release()
        pool.close()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 1x\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: ²00\r\n\r\n".encode(),
        b"HTTP/1.1 2000 OK\r\n\r\n",
    ],
)
async def test_a_malformed_head_fails_the_request_itself(head: bytes) -> None:
    async with scripted(lambda _: head) as (_, url):
        pool = Pool(5, 5)
        with pytest.raises(UpstreamBroken):
            await pool.request(url, "/", "POST", b"{}", [])


@pytest.mark.parametrize("size", [b"-3", b"0x3", b"1_0", b"\xc2\xb2"])
async def test_a_chunk_size_that_is_not_hex_digits_is_broken(size: bytes) -> None:
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + size + b"\r\nabc\r\n"
    async with scripted(lambda _: answer) as (_, url):
        pool = Pool(5, 1)
        response = await pool.request(url, "/", "POST", b"{}", [])
        with pytest.raises(UpstreamBroken):
            await response.read()


async def test_a_body_to_the_connections_end_cut_by_a_reset_is_broken() -> None:
    async with scripted(lambda _: b"HTTP/1.1 200 OK\r\n\r\npartial", reset=True) as (_, url):
        pool = Pool(5, 5)
        response = await pool.request(url, "/", "GET", None, [])
        with pytest.raises(UpstreamBroken):
            await response.read()


async def test_a_request_the_server_began_to_answer_is_not_sent_again() -> None:
    served = 0

    def answer(head: bytes) -> bytes | tuple[bytes, str]:
        nonlocal served
        served += 1
        return ok() if served == 1 else (b"HTTP/1.1 100 Continue\r\n\r\n", "close")

    async with scripted(answer) as (server, url):
        pool = Pool(5, 5)
        assert (await exchange(pool, url, "GET", None))[0] == 200
        with pytest.raises(UpstreamBroken):  # an interim head came: the request was read
            await exchange(pool, url, "GET", None)
        pool.close()
    assert len(server.heads) == 2


def test_a_header_with_a_line_break_is_refused() -> None:
    pool = Pool(5, 5)
    with pytest.raises(UpstreamBroken, match="line break"):
        asyncio.run(pool.request("http://127.0.0.1:1", "/", "GET", None, [("X", "a\r\nB: c")]))


def test_the_host_header_and_path_prefix_follow_the_base_url() -> None:
    assert Origin.of("http://[::1]:8080").host_header == "[::1]:8080"
    assert Origin.of("https://llama.example/api").prefix == "/api"
    assert Origin.of("https://llama.example/api").host_header == "llama.example"
    assert Origin.of("https://llama.example/api").port == 443


@pytest.mark.parametrize(
    "answer",
    [
        # a chunk-size line that is not hex, then chunks that are: the error stands
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\nzz\r\n3\r\nabc\r\n0\r\n\r\n",
        # two Content-Length lines that differ
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 4\r\n\r\nokok",
    ],
    ids=["bad-chunk-then-good", "two-lengths"],
)
async def test_a_framing_error_is_final_whatever_bytes_follow_it(answer: bytes) -> None:
    async with scripted(lambda _: answer) as (_, url):
        pool = Pool(5, 1)
        with pytest.raises(UpstreamBroken):  # (the head, or else reading the body)
            await exchange(pool, url)
        pool.close()


async def test_a_malformed_head_is_not_followed_by_the_head_after_it() -> None:
    forged = (
        b"HTTP/1.1 200 OK\r\nBogus\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 6\r\n\r\nforged"
    )
    async with scripted(lambda _: forged) as (_, url):
        pool = Pool(5, 1)
        with pytest.raises(UpstreamBroken):
            await pool.request(url, "/", "POST", b"{}", [])
        pool.close()


@pytest.mark.parametrize(
    ("codings", "expected", "connections"),
    [
        (b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n", b"ok", 1),
        (b"Transfer-Encoding: chunked, gzip\r\nConnection: close\r\n", b"2\r\nok\r\n0\r\n\r\n", 2),
    ],
    ids=["chunked-last-on-its-own-line", "chunked-not-last"],
)
async def test_the_transfer_codings_of_every_line_frame_the_body(
    codings: bytes, expected: bytes, connections: int
) -> None:
    """Chunked framing only when ``chunked`` is the last coding, over all the lines; any
    other coding list runs to the connection's end (and the connection is not reused)."""
    answer = b"HTTP/1.1 200 OK\r\n" + codings + b"\r\n2\r\nok\r\n0\r\n\r\n"
    close_after = connections == 2
    async with scripted(lambda _: answer, close_after=close_after) as (server, url):
        pool = Pool(5, 5)
        for _ in range(2):
            assert await exchange(pool, url) == (200, expected)
        pool.close()
    assert server.connections == connections


async def test_a_connection_is_idle_from_its_answers_last_byte_not_from_its_release() -> None:
    """The server's keep-alive timer starts at its last write: an answer read, and its
    connection given back, seconds later (the relay's bookkeeping) is as old as its last
    byte."""
    now = [100.0]
    async with scripted(lambda _: ok()) as (server, url):
        pool = Pool(5, 5, clock=lambda: now[0])
        response = await pool.request(url, "/", "POST", b"{}", [])  # (all of it came)
        now[0] += IDLE_SECONDS - 1.0
        await response.read()  # given back now
        response.release()
        now[0] += 1.5  # past the bound since the last byte, not since the release
        assert await exchange(pool, url) == (200, b'{"x": 1}')
        pool.close()
    assert server.connections == 2


async def test_the_one_retry_goes_out_on_a_new_connection() -> None:
    """Two kept-alive connections that the server closes as they are reused (its keep-alive
    timer ran out as each request crossed it): the retry does not take the second one."""
    connections: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        stale, answered = len(connections) <= 2, False  # (the first two go stale)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                if stale and answered:
                    break  # closed unanswered
                writer.write(ok())
                await writer.drain()
                answered = True
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    port = free_port()
    listening = await asyncio.start_server(serve, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    pool = Pool(5, 5)
    both = [await pool.request(url, "/", "GET", None, []) for _ in range(2)]
    for response in both:
        await response.read()
        response.release()
    assert await exchange(pool, url, "GET", None) == (200, b'{"x": 1}')
    pool.close()
    listening.close()
    await listening.wait_closed()
    assert len(connections) == 3


async def test_no_connection_in_time_is_a_connect_error_as_nothing_was_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller then tries another backend and frees the slot clean, as for a refusal
    (not a 504 with a slot left to drain)."""
    client = LlamaServerClient(None, TimeoutSettings(connect_seconds=0.5))

    async def no_connection(*args: object) -> Response:
        raise ConnectTimeout()

    monkeypatch.setattr(client._pool, "request", no_connection)
    with pytest.raises(UpstreamConnectError):
        async with client.send("http://127.0.0.1:1", "/", method="POST", body=b"{}", headers=[]):
            pass

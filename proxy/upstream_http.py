"""HTTP/1.1 to the backends on the request path: keep-alive connections and a lean exchange.

Every proxied request crosses two HTTP hops, and on the proxy's side of the second one a
general client does far more than a relay needs (request and response objects, tracing
hooks, cookie and redirect handling, a timer per phase). This client does only what a relay
needs, on ``asyncio.Protocol``:

- *Connections.* Each backend (scheme, host, port) has a stack of idle keep-alive
  connections; a request takes the most recent one, or opens one (bounded by the connect
  timeout). One idle for ``IDLE_SECONDS`` since its last answer's last byte (when the
  server's own timer starts, however long the relay takes to give it back) is closed rather
  than reused: the server may be closing it at that moment (llama-server's HTTP library
  closes an idle connection after 5 s), and a request sent on a connection as it closes is
  lost. A connection carries one
  exchange at a time and goes back to the stack only when its response was read to its
  end, the server did not ask to close, and no stray byte followed it (a malformed ``204``
  followed by an empty chunked body, as some llama-server endpoints send, is read as
  bodiless and its connection closed). A connection the server closes while idle leaves the
  stack. A connection given back unfinished (the client left, an error) is closed, so the
  server cancels the task.
- *The exchange.* The request goes out as one write: the request line, ``Host``,
  the headers given (the caller has filtered them), ``Content-Length`` when there is a body
  (and for a bodiless ``POST``). The response head is parsed (status line, headers decoded
  as UTF-8 with surrogate escapes, as aiohttp does, so bytes relayed back are the bytes
  received); ``1xx`` interim heads are skipped (a ``101`` ends the exchange, and its
connection is closed). The body is framed by the method and
  status (``HEAD``, ``1xx``, ``204``, ``304``: none), else ``Transfer-Encoding`` (chunked
  when ``chunked`` is the last coding of all its lines, chunk extensions and trailers read
  and dropped; any other coding runs to the end of the connection), else
  ``Content-Length`` (lines that differ frame nothing: the answer is broken), else it runs
  to the end of the connection. A framing error is final: the bytes after it are not read
  as more of the answer.
- *Streaming.* Body bytes are handed over as they arrive (``chunks``), so a server-sent
  event stream is relayed event by event; reading pauses while more than ``HIGH_WATER``
  bytes wait for a slow client, and resumes below ``LOW_WATER``.
- *Timeouts.* ``read_seconds`` bounds every silence: before the head and between two
  reads of the body, as aiohttp's ``sock_read``. ``connect_seconds`` bounds a connect.

Errors: ``ConnectFailed`` when no byte was sent (refused, unreachable, no route);
``ReadTimeout`` on a silence past the read bound, ``ConnectTimeout`` past the connect bound
(both ``TimeoutError``); ``UpstreamBroken`` for a connection lost (or reset before a body
that runs to its end was whole) or an answer that is not HTTP/1.x (a malformed head fails
the request itself). A request on a reused connection that the server had closed (its
keep-alive timer) before any byte of the answer came is sent again once, on a new
connection, when its method is idempotent.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast

from multidict import CIMultiDict
from yarl import URL

HIGH_WATER = 256 * 1024  # bytes buffered for a slow reader before reading pauses
LOW_WATER = 64 * 1024  # bytes buffered below which reading resumes
MAX_HEAD = 64 * 1024  # bytes of a response head beyond which the answer is not HTTP
IDLE_SECONDS = 4.0  # s: an idle connection older than this is not reused (the server's is 5)
IDLE_KEPT = 128  # idle connections kept per backend: a burst's others are closed, not left
# open at the server (and listed here) until it times them out
_DIGITS = re.compile(r"[0-9]{1,18}")  # a status code or Content-Length (ASCII digits only)
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")  # a chunk size
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "PUT"})


class UpstreamBroken(Exception):
    """The connection was lost, or the answer is not HTTP/1.x."""


class ConnectFailed(UpstreamBroken):
    """No connection could be made: nothing was sent."""


class ConnectTimeout(TimeoutError):
    """No connection within the connect timeout: nothing was sent."""


class ReadTimeout(TimeoutError):
    """The backend was silent past the read bound (before the head, or within the body)."""


@dataclass(frozen=True)
class Origin:
    """Where a backend listens, read once from its base URL."""

    host: str
    port: int
    tls: bool
    prefix: str  # the base URL's path ('' or '/llama'), put before each request's path
    host_header: str

    @classmethod
    def of(cls, base_url: str) -> Origin:
        url = URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"not an http(s) URL: {base_url}")
        port = url.port or (443 if url.scheme == "https" else 80)
        host = f"[{url.host}]" if ":" in url.host else url.host  # (an IPv6 address)
        shown = host if url.is_default_port() else f"{host}:{port}"
        return cls(url.host, port, url.scheme == "https", url.raw_path.rstrip("/"), shown)


class _Connection(asyncio.Protocol):
    """One keep-alive connection: parses the answer to the request in flight."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._buffer = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self.response: Response | None = None
        self._paused = False
        self.idle_since = 0.0  # when its last answer's last byte came (the pool's clock)
        self.answered = False  # a byte of the answer in flight arrived (the request was read)

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes on an idle connection: not reusable
            self.lost = True
            if self.transport is not None:
                self.transport.close()
            return
        self.answered = True
        self._buffer += data
        self.response._feed()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close the transport: the server is done with this connection

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.response is not None:
            self.response._feed(eof=True, reset=exc is not None)
        self._wake()

    # -- the reader's side ---------------------------------------------------------------
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, seconds: float) -> None:
        """Until more bytes (or the end) arrive, at most ``seconds``."""
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(seconds, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def pause(self, paused: bool) -> None:
        if paused != self._paused and self.transport is not None and not self.lost:
            self._paused = paused
            (self.transport.pause_reading if paused else self.transport.resume_reading)()

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(ReadTimeout())


class Response:
    """A backend's answer: status and headers read, the body read as it comes."""

    def __init__(self, conn: _Connection, pool: Pool, origin: Origin, method: str) -> None:
        self._conn, self._pool, self._origin, self._method = conn, pool, origin, method
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self._head_read = False
        self._framing = ""  # "none", "length", "chunked", "close"
        self._left = 0  # bytes left of the body, or of the current chunk
        self._chunk_state = "size"  # "size", "data", "crlf", "trailer"
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._done = False  # the body read to its end
        self._eof = False  # the connection ended
        self._error: Exception | None = None
        self._reusable = True

    @property
    def content_type(self) -> str:
        raw = self.headers.get("Content-Type", "application/octet-stream")
        return raw.split(";", 1)[0].strip().lower()

    # -- parsing (called by the connection as bytes arrive) ------------------------------
    def _feed(self, eof: bool = False, reset: bool = False) -> None:
        """Parse what arrived; ``eof``: the connection ended (``reset``: abnormally). An error
        is final: the bytes after it are not parsed (the close it makes feeds the end)."""
        if eof:
            self._eof = True
        if self._error is not None:
            return
        done = self._done
        try:
            if not self._head_read:
                self._parse_head()
            if self._head_read and not self._done:
                self._parse_body()
        except (UpstreamBroken, ValueError) as exc:  # (ValueError: a number not HTTP's)
            self._error = exc if isinstance(exc, UpstreamBroken) else UpstreamBroken(str(exc))
            self._conn.close()
            return
        if eof and not self._done and self._error is None:
            if self._head_read and self._framing == "close" and not reset:
                self._done = True  # the body ran to the connection's end
            else:
                self._error = UpstreamBroken("connection closed by the backend")
        if self._done and not done:  # the server's keep-alive timer starts at its last byte
            self._conn.idle_since = self._pool.clock()
        if self._buffered > HIGH_WATER:
            self._conn.pause(True)

    def _parse_head(self) -> None:
        buffer = self._conn._buffer
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD:
                    raise UpstreamBroken("response head too large")
                return
            lines = bytes(buffer[:end]).decode("utf-8", "surrogateescape").split("\r\n")
            del buffer[: end + 4]
            version, _, rest = lines[0].partition(" ")
            code = rest.partition(" ")[0]
            if not version.startswith("HTTP/1.") or len(code) != 3 or not _DIGITS.fullmatch(code):
                raise UpstreamBroken(f"not an HTTP/1.x status line: {lines[0][:40]!r}")
            status = int(code)
            if 100 <= status < 200 and status != 101:
                continue  # an interim head (100 Continue): the answer follows
            headers: CIMultiDict[str] = CIMultiDict()
            for line in lines[1:]:
                name, colon, value = line.partition(":")
                if not colon or not name or name != name.strip():
                    raise UpstreamBroken(f"malformed header line: {line[:40]!r}")
                headers.add(name, value.strip(" \t"))
            self.status, self.headers = status, headers
            self._frame(version)
            self._head_read = True  # (only once framed: a malformed head fails the request)
            return

    def _frame(self, version: str) -> None:
        """The body's framing, from every line of the headers that decide it: a transfer
        coding list whose last is ``chunked`` is chunked, any other runs to the connection's
        end; ``Content-Length`` lines (or list members) that differ are no framing at all."""
        connection = self._values("Connection")
        if "close" in connection or (version == "HTTP/1.0" and "keep-alive" not in connection):
            self._reusable = False
        codings = self._values("Transfer-Encoding")
        lengths = set(self._values("Content-Length"))
        if self._method == "HEAD" or self.status in (204, 304) or self.status < 200:
            self._framing, self._done = "none", True
            # (a 204 may be followed by an empty chunked body, and a 101 by another protocol:
            # their connections are not reused)
            self._reusable = self._reusable and self.status not in (101, 204)
        elif codings:
            chunked = codings[-1] == "chunked"
            self._framing = "chunked" if chunked else "close"
            self._reusable = self._reusable and chunked
        elif lengths:
            (length,) = lengths if len(lengths) == 1 else ("",)
            if not _DIGITS.fullmatch(length):
                raise UpstreamBroken("malformed Content-Length")
            self._framing, self._left = "length", int(length)
            self._done = self._left == 0
        else:
            self._framing, self._reusable = "close", False

    def _values(self, name: str) -> list[str]:
        """The comma-separated members of every ``name`` header line, in order, lowercased."""
        lines = self.headers.getall(name, ())
        return [v.strip().lower() for line in lines for v in line.split(",") if v.strip()]

    def _take(self, data: bytes) -> None:
        if data:
            self._body.append(data)
            self._buffered += len(data)

    def _parse_body(self) -> None:
        buffer = self._conn._buffer
        if self._framing == "length":
            data = bytes(buffer[: self._left])
            del buffer[: len(data)]
            self._left -= len(data)
            self._take(data)
            self._done = self._left == 0
        elif self._framing == "close":
            self._take(bytes(buffer))
            buffer.clear()
        else:
            self._parse_chunks(buffer)
        if self._done and buffer:
            self._reusable = False  # a stray byte after the answer: the framing is off

    def _parse_chunks(self, buffer: bytearray) -> None:
        while not self._done:
            if self._chunk_state == "data":
                data = bytes(buffer[: self._left])
                del buffer[: len(data)]
                self._left -= len(data)
                self._take(data)
                if self._left:
                    return
                self._chunk_state = "crlf"
            end = buffer.find(b"\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD:
                    raise UpstreamBroken("malformed chunked body")
                return
            line = bytes(buffer[:end])
            del buffer[: end + 2]
            if self._chunk_state == "crlf":
                if line:
                    raise UpstreamBroken("malformed chunked body")
                self._chunk_state = "size"
            elif self._chunk_state == "size":
                size = line.split(b";", 1)[0].strip()
                if not _HEX.fullmatch(size):
                    raise UpstreamBroken("malformed chunk size")
                self._left = int(size, 16)
                self._chunk_state = "data" if self._left else "trailer"
            elif not line:  # the empty line that ends the trailers
                self._done = True

    # -- the reader's side ---------------------------------------------------------------
    async def _head(self, read_seconds: float) -> None:
        while not self._head_read:
            self._raise()
            await self._conn.wait(read_seconds)
        self._maybe_return()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive."""
        read_seconds = self._pool.read_seconds
        while True:
            while self._body:
                data = self._body.popleft()
                self._buffered -= len(data)
                if self._buffered < LOW_WATER:
                    self._conn.pause(False)
                yield data
            if self._done:
                self._maybe_return()
                return
            self._raise()
            await self._conn.wait(read_seconds)

    async def read(self) -> bytes:
        """The whole body."""
        if self._done:  # (all of it came with the head, as a small answer does)
            parts = list(self._body)
            self._body.clear()
            self._buffered = 0
            if self._conn.response is self:  # (not yet given back to the pool)
                self._conn.pause(False)
            self._maybe_return()
        else:
            parts = [data async for data in self.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _maybe_return(self) -> None:
        """Give the connection back once the answer is read to its end."""
        if self._done and not self._body and self._conn.response is self:
            self._conn.response = None
            if self._reusable and not self._conn.lost and not self._conn._buffer:
                self._pool._give_back(self._origin, self._conn)
            else:
                self._conn.close()

    def release(self) -> None:
        """Done with the answer: its connection is reused if it was read to its end."""
        if self._conn.response is self:
            if self._done and not self._body:
                self._maybe_return()
            else:
                self.close()

    def abort(self, reason: str) -> None:
        """End the answer now (the proxy stops): a reader waiting for the body gets
        ``UpstreamBroken(reason)``, and the connection is closed (the server cancels the task)."""
        if self._error is None and not self._done:
            self._error = UpstreamBroken(reason)
        self._conn._wake()
        self.close()

    def close(self) -> None:
        """Done with the answer, unfinished: its connection is closed."""
        if self._conn.response is self:
            self._conn.response = None
            self._conn.close()


class Pool:
    """Keep-alive connections to every backend, and the request they carry."""

    def __init__(
        self,
        connect_seconds: float,
        read_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        on_open: Callable[[str], None] | None = None,
    ) -> None:
        """``on_open(base_url)``: told of each connection opened (the metrics)."""
        self.connect_seconds, self.read_seconds, self.clock = connect_seconds, read_seconds, clock
        self._on_open = on_open
        self._idle: dict[Origin, list[_Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    def origin(self, base_url: str) -> Origin:
        found = self._origins.get(base_url)
        if found is None:
            found = self._origins[base_url] = Origin.of(base_url)
        return found

    async def request(
        self,
        base_url: str,
        path: str,
        method: str,
        body: bytes | None,
        headers: list[tuple[str, str]],
        head_seconds: float | None = None,
    ) -> Response:
        """Send the request; returns the answer with its head read, within ``head_seconds``
        (default: ``read_seconds``)."""
        origin = self.origin(base_url)
        head = _head(origin, method, path, body, headers)
        for attempt in (1, 2):
            conn, reused = await self._connection(base_url, origin, reuse=attempt == 1)
            response = Response(conn, self, origin, method)
            conn.response, conn.answered = response, False
            assert conn.transport is not None
            try:
                if body:
                    conn.transport.writelines((head, body))
                else:
                    conn.transport.write(head)
                await response._head(head_seconds or self.read_seconds)
            except UpstreamBroken:
                response.close()
                if reused and attempt == 1 and method in _IDEMPOTENT and not conn.answered:
                    continue  # the server closed the idle connection as it was reused
                raise
            except BaseException:
                response.close()
                raise
            return response
        raise AssertionError("unreachable")

    async def _connection(
        self, base_url: str, origin: Origin, reuse: bool = True
    ) -> tuple[_Connection, bool]:
        idle = self._idle.get(origin) if reuse else None
        if idle:
            fresh = self.clock() - IDLE_SECONDS
            while idle:
                conn = idle.pop()
                closing = conn.lost or conn.transport is None or conn.transport.is_closing()
                if not closing and conn.idle_since >= fresh:
                    return conn, True
                conn.close()
        loop = asyncio.get_running_loop()
        tls = self._context() if origin.tls else None
        opening = loop.create_connection(
            lambda: _Connection(loop), origin.host, origin.port, ssl=tls
        )
        try:
            async with asyncio.timeout(self.connect_seconds):
                _, conn = await opening
        except TimeoutError:
            raise ConnectTimeout() from None
        except OSError as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__) from None
        if self._on_open is not None:
            self._on_open(base_url)
        return conn, False

    def _context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _give_back(self, origin: Origin, conn: _Connection) -> None:
        if self._closed:  # (an answer read to its end after the pool closed)
            conn.close()
            return
        idle = self._idle.setdefault(origin, [])
        idle.append(conn)  # (idle since its answer's last byte; reused last in, first out)
        if len(idle) > IDLE_KEPT:
            idle.pop(0).close()  # the one idle longest

    def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _head(
    origin: Origin, method: str, path: str, body: bytes | None, headers: list[tuple[str, str]]
) -> bytes:
    lines = [f"{method} {origin.prefix}{path} HTTP/1.1", f"Host: {origin.host_header}"]
    for name, value in headers:
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
            raise UpstreamBroken(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    if body is not None or method == "POST":
        lines.append(f"Content-Length: {len(body or b'')}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")

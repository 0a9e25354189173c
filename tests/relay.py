"""A TCP relay in front of a real server (Redis here), to give one client a network of its
own: slow (``lag``: the connection and every reply held back) or cut (``cut``: every
connection closed, new ones refused until ``mend``), while other clients reach the server
directly."""

from __future__ import annotations

import asyncio
import contextlib


class Relay:
    def __init__(self, url: str, lag: float = 0.0) -> None:
        host_port = url.split("://", 1)[-1].split("/")[0]
        self._host, port = host_port.rsplit(":", 1)
        self._port, self._lag = int(port), lag
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.broken = False

    async def start(self) -> str:
        """The relay's address, as the URL to give the client (``redis://host:port/0``)."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"

    def cut(self) -> None:
        self.broken = True
        for writer in list(self._writers):
            writer.close()

    def mend(self) -> None:
        self.broken = False

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(self._lag)
        if self.broken:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(self._host, self._port)
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, 0.0), self._pipe(up_reader, writer, self._lag)
            )
        finally:
            self._writers -= {writer, up_writer}

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, lag: float) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while (data := await src.read(65536)) and not self.broken:
                await asyncio.sleep(lag)
                dst.write(data)
                await dst.drain()
        dst.close()

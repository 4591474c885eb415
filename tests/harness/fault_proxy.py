"""A TCP proxy in a background thread that breaks a connection on purpose: it adds latency,
freezes (connections stay open, nothing is forwarded), or cuts every connection. With a server
``ssl.SSLContext`` it also terminates TLS in front of a plain server.

Tests point a service at :attr:`FaultProxy.port` instead of the real server, then turn the
faults on and off while traffic flows.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from dataclasses import dataclass, field

_CHUNK = 64 * 1024


@dataclass
class FaultProxy:
    target_host: str
    target_port: int
    server_ssl: ssl.SSLContext | None = None
    host: str = "127.0.0.1"
    port: int = 0
    delay_s: float = 0.0
    """Added before each chunk is forwarded, in both directions."""
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _server: asyncio.Server | None = None
    _flowing: asyncio.Event | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    def start(self) -> FaultProxy:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            loop.run_until_complete(self._listen())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    async def _listen(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._handle, self.host, self.port,
                                                  ssl=self.server_ssl)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host,
                                                                 self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._flowing is not None
        try:
            while data := await reader.read(_CHUNK):
                await self._flowing.wait()
                if self.delay_s > 0:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                writer.close()

    def _call(self, what: str) -> None:
        loop = self._loop
        assert loop is not None and self._flowing is not None
        done = threading.Event()

        def act() -> None:
            assert self._flowing is not None
            if what == "freeze":
                self._flowing.clear()
            elif what == "thaw":
                self._flowing.set()
            elif what == "cut":
                for writer in list(self._writers):
                    writer.transport.abort()
                self._writers.clear()
            done.set()

        loop.call_soon_threadsafe(act)
        done.wait(5)

    def freeze(self) -> None:
        """Stop forwarding: connections stay open, requests get no answer."""
        self._call("freeze")

    def thaw(self) -> None:
        self._call("thaw")

    def cut(self) -> None:
        """Abort every open connection (new ones are still accepted)."""
        self._call("cut")

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            if self._flowing is not None:
                self._loop.call_soon_threadsafe(self._flowing.set)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None

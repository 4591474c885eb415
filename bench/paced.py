"""A minimal HTTP/1.1 server that streams a chat completion one SSE event at a time.

``python -m bench.paced --port N --tokens T --interval-ms MS``: every POST gets a chunked
``text/event-stream`` response whose events (see :func:`bench.bodies.sse_events`) are written
``MS`` apart, so Envoy forwards each as its own body chunk, as with a decoding vLLM pod. GET
``/health`` answers 200. Plain asyncio streams and no framework: its own CPU stays small.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from dataclasses import dataclass

from bench import bodies


@dataclass(frozen=True)
class PacedPool:
    """One paced server of a run: its cluster in the routing YAML, the model routed to it and
    what it streams (``tokens`` events ``interval_ms`` apart)."""

    cluster: str
    model: str
    tokens: int
    interval_ms: float


POOLS = (
    PacedPool("paced", bodies.PACED_MODEL, 16, 5.0),
    # As a decoding vLLM pod streams a long answer: ~33 tokens/s per stream, ~7.7 s each.
    PacedPool("paced256", bodies.PACED256_MODEL, 256, 30.0),
)

_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
         b"transfer-encoding: chunked\r\n\r\n")
_OK = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     events: list[bytes], interval_s: float) -> bool:
    """One request on the connection; False when the client closed it."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return False
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    if length:
        await reader.readexactly(length)
    if head.startswith(b"GET"):
        writer.write(_OK)
        await writer.drain()
        return True
    writer.write(_HEAD)
    for event in events:
        writer.write(_chunk(event))
        await writer.drain()
        await asyncio.sleep(interval_s)
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return True


async def serve(port: int, tokens: int, interval_ms: float) -> None:
    events = [e.encode() for e in bodies.sse_events(tokens)]
    interval_s = interval_ms / 1000

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await _serve_one(reader, writer, events, interval_s):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--interval-ms", type=float, default=5.0)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, args.tokens, args.interval_ms))


if __name__ == "__main__":
    main()

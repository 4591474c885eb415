"""A cheap ext_proc load client: raw HTTP/2 frames, prebuilt bytes, no gRPC library.

    python -m bench.h2_extproc_load PORT SECONDS CONNECTIONS STREAMS BODIES_FILE

A grpc.aio client costs about as much CPU per message as extproc itself, so on two cores it
cannot show whether a second extproc worker helps (the client takes the second core). This one
sends each stream's four ext_proc messages as one prebuilt write (HEADERS + one DATA frame of
four length-prefixed gRPC messages, stream id patched in), counts the gRPC messages that come
back, and resets the stream after the fourth, as Envoy does. ``STREAMS`` streams are kept
open per connection. It prints ``ready``, waits for a line on stdin, runs ``SECONDS``, prints
one JSON line: messages, streams, seconds, cpu (this process's CPU seconds).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hpack import Encoder, NeverIndexedHeaderTuple

from sidecar_runtime.h2grpc.frames import (
    ACK,
    CANCEL,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PING,
    PREFACE,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    frame,
    length_prefixed,
    rst_stream,
    settings,
    window_update,
)

MESSAGES_PER_STREAM = 4


def headers(phase: str, pairs: list[tuple[str, str]]) -> pb.ProcessingRequest:
    """An ext_proc headers message as Envoy sends it (``raw_value``, not ``value``)."""
    message = pb.ProcessingRequest()
    for key, value in pairs:
        header = getattr(message, phase).headers.headers.add()
        header.key, header.raw_value = key, value.encode()
    return message


def body(phase: str, raw: bytes) -> pb.ProcessingRequest:
    """An ext_proc body message carrying the whole body."""
    message = pb.ProcessingRequest()
    getattr(message, phase).body = raw
    getattr(message, phase).end_of_stream = True
    return message


def grpc_messages(request_body: bytes, response_body: bytes) -> bytes:
    stream = [
        headers("request_headers", [(":method", "POST"), (":path", "/v1/chat/completions"),
                                    (":authority", "bench"), ("content-type", "application/json"),
                                    ("authorization", "Bearer sk-bench")]),
        body("request_body", request_body),
        headers("response_headers", [(":status", "200"), ("content-type", "application/json")]),
        body("response_body", response_body),
    ]
    out = b""
    for message in stream:
        out += length_prefixed(message.SerializeToString())
    return out


class Connection(asyncio.Protocol):
    def __init__(self, streams: int, header_block: bytes, data: bytes,
                 counts: dict[str, int], running: list[bool], finished: asyncio.Event) -> None:
        self._streams = streams
        self._headers = header_block
        self._data = data
        self._counts = counts
        self._running = running
        self._finished = finished
        self._buffer = b""
        self._pending: dict[int, list[int]] = {}  # stream -> [messages, bytes of a partial]
        self._next_id = 1
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(PREFACE + settings({SETTINGS_INITIAL_WINDOW_SIZE: MAX_WINDOW})
                        + window_update(0, MAX_WINDOW - DEFAULT_WINDOW))

    def start_streams(self) -> None:
        for _ in range(self._streams):
            self._open()

    def _open(self) -> None:
        assert self.transport is not None
        stream = self._next_id
        self._next_id += 2
        self._pending[stream] = [0, 0]
        self.transport.write(frame(HEADERS, END_HEADERS, stream, self._headers)
                             + frame(DATA, 0, stream, self._data))

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data
        offset = 0
        out = b""
        while len(buffer) - offset >= 9:
            length = int.from_bytes(buffer[offset:offset + 3], "big")
            if len(buffer) - offset < 9 + length:
                break
            kind, flags = buffer[offset + 3], buffer[offset + 4]
            stream = int.from_bytes(buffer[offset + 5:offset + 9], "big") & MAX_WINDOW
            payload = buffer[offset + 9:offset + 9 + length]
            offset += 9 + length
            if kind == SETTINGS and not flags & ACK:
                out += frame(SETTINGS, ACK, 0, b"")
            elif kind == PING and not flags & ACK:
                out += frame(PING, ACK, 0, payload)
            elif kind == GOAWAY:
                self._running[0] = False
            elif kind == DATA and stream in self._pending:
                out += self._on_data(stream, payload)
            elif kind == HEADERS and flags & END_STREAM and stream in self._pending:
                self._finish(stream)  # trailers before four answers (an error)
        self._buffer = buffer[offset:]
        if out and self.transport is not None:
            self.transport.write(out)

    def _on_data(self, stream: int, payload: bytes) -> bytes:
        state = self._pending[stream]
        # gRPC messages: 1 flag byte + 4 length bytes + message, possibly split over frames.
        position = 0
        while position < len(payload):
            if state[1] == 0:
                if len(payload) - position < 5:
                    raise RuntimeError("a gRPC message prefix split over frames")
                state[1] = 5 + int.from_bytes(payload[position + 1:position + 5], "big")
            take = min(state[1], len(payload) - position)
            state[1] -= take
            position += take
            if state[1] == 0:
                state[0] += 1
        if state[0] >= MESSAGES_PER_STREAM:
            self._finish(stream)
            return rst_stream(stream, CANCEL)
        return b""

    def _finish(self, stream: int) -> None:
        messages = self._pending.pop(stream)[0]
        self._counts["messages"] += messages
        self._counts["streams"] += 1
        self._finished.set()
        if self._running[0]:
            self._open()
        elif not self._pending and not self.closed.done():
            self.closed.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def main(port: int, seconds: float, connections: int, streams: int,
               request_body: bytes, response_body: bytes) -> None:
    header_block = Encoder().encode([NeverIndexedHeaderTuple(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"),
        (":path", "/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
        (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
        ("te", "trailers"))])
    data = grpc_messages(request_body, response_body)
    counts = {"messages": 0, "streams": 0}
    running = [True]
    warmed = asyncio.Event()
    loop = asyncio.get_running_loop()
    protocols: list[Connection] = []
    for _ in range(connections):
        _, protocol = await loop.create_connection(
            lambda: Connection(streams, header_block, data, counts, running, warmed),
            "127.0.0.1", port)
        protocols.append(protocol)
    for protocol in protocols:  # warm up: one round on every connection
        protocol.start_streams()
    while counts["streams"] < connections * streams:
        warmed.clear()
        await warmed.wait()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await loop.run_in_executor(None, sys.stdin.readline)
    counts["messages"] = counts["streams"] = 0
    began, cpu = time.perf_counter(), time.process_time()
    await asyncio.sleep(seconds)
    running[0] = False
    elapsed = time.perf_counter() - began
    snapshot = dict(counts)  # streams still open at the end are not counted
    cpu = time.process_time() - cpu
    await asyncio.wait([asyncio.ensure_future(p.closed) for p in protocols], timeout=10)
    for protocol in protocols:
        if protocol.transport is not None:
            protocol.transport.close()
    print(json.dumps({**snapshot, "seconds": elapsed, "cpu": cpu}), flush=True)


if __name__ == "__main__":
    port_, seconds_, connections_, streams_, bodies_ = sys.argv[1:6]
    with open(bodies_, "rb") as handle:
        request_, response_ = handle.read().split(b"\0")
    asyncio.run(main(int(port_), float(seconds_), int(connections_), int(streams_), request_,
                     response_))

"""The client against servers that misbehave or push its limits: garbage, an oversized frame,
answers without ``grpc-status`` or not gRPC at all, a connection cut mid-call, a GOAWAY below
the calls sent, a stream limit of one with tiny windows (checked by ``h2``'s state machine), and
a server that goes silent. Each call fails (or succeeds) with a status; none hangs, and nothing
escapes into the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import h2.settings
import pytest

from sidecar_runtime.h2grpc import client_connection
from sidecar_runtime.h2grpc import frames as f
from sidecar_runtime.h2grpc.client import Channel
from sidecar_runtime.h2grpc.status import RpcError, StatusCode
from tests.harness.waits import until
from tests.sidecar_runtime.h2grpc.peers import H2Peer, read_until_closed, scripted

WAIT_S = 20.0
"""A bound for a client that hangs, not a performance figure."""


@pytest.fixture(autouse=True)
async def loop_errors() -> AsyncIterator[None]:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    yield
    loop.set_exception_handler(None)
    assert errors == []


async def fails(channel: Channel, timeout_s: float = 10) -> RpcError:
    with pytest.raises(RpcError) as failed:
        await asyncio.wait_for(channel.unary("/t.S/M", b"request", timeout_s), WAIT_S)
    return failed.value


async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      answers: list[tuple[list[tuple[str, str]], bytes | None,
                                          list[tuple[str, str]] | None]]) -> None:
    """Answer the calls in order with (headers, message or None, trailers or None)."""
    peer = H2Peer(reader, writer)
    scripted_answers = iter(answers)
    async for request in peer.requests():
        headers, message, trailers = next(scripted_answers)
        peer.conn.send_headers(request.stream, headers, end_stream=trailers is None
                               and message is None)
        if message is not None:
            peer.conn.send_data(request.stream, b"\0" + len(message).to_bytes(4, "big")
                                + message, end_stream=trailers is None)
        if trailers is not None:
            peer.conn.send_headers(request.stream, trailers, end_stream=True)
        peer.flush()


GRPC = [(":status", "200"), ("content-type", "application/grpc")]


async def test_answers_that_are_not_well_formed_grpc() -> None:
    answers = [
        (GRPC, b"ok", [("grpc-status", "0")]),
        (GRPC, b"x", [("grpc-message", "no status")]),  # trailers without grpc-status
        ([(":status", "200"), ("content-type", "application/grpc")], None, None),  # ends there
        ([(":status", "503"), ("content-type", "text/plain")], None, None),  # not gRPC
        ([*GRPC, ("grpc-status", "5"), ("grpc-message", "no%20such%ZZthing %E2%9C%93")],
         None, None),  # trailers-only, percent-encoded, one bad escape
        (GRPC, None, [("grpc-status", "0")]),  # OK without a message
        (GRPC, b"y", [("grpc-status", "99")]),  # a code gRPC does not have
        ([(":status", "404")], None, None),
        (GRPC, b"last", [("grpc-status", "0")]),
    ]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_each(reader, writer, answers)

    async with scripted(script) as (address, accepted):
        channel = Channel(address)
        assert await channel.unary("/t.S/M", b"", 10) == b"ok"
        got = [await fails(channel) for _ in range(7)]
        assert [(e.code, e.details) for e in got] == [
            (StatusCode.INTERNAL, "the answer ended without grpc-status"),
            (StatusCode.INTERNAL, "the answer ended without grpc-status"),
            (StatusCode.UNAVAILABLE, "the server answered HTTP 503, not gRPC"),
            (StatusCode.NOT_FOUND, "no such%ZZthing ✓"),
            (StatusCode.INTERNAL, "an answer that is not one whole message"),
            (StatusCode.UNKNOWN, ""),
            (StatusCode.UNIMPLEMENTED, "the server answered HTTP 404, not gRPC"),
        ]
        assert await channel.unary("/t.S/M", b"", 10) == b"last"  # one connection all along
        assert accepted.connections == 1
        await channel.aclose()


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 400 Bad Request\r\n\r\n",  # not HTTP/2
    f.settings({}) + (20_000).to_bytes(3, "big") + bytes((f.DATA, 0)) + (1).to_bytes(4, "big"),
    f.frame(f.PING, 0, 0, b"\0" * 8),  # anything but SETTINGS first
    f.settings({}) + f.frame(f.HEADERS, f.END_HEADERS, 1, b"\xff\xff\xff\xff"),  # bad HPACK
    f.settings({}) + f.frame(f.DATA, 0, 2, b"x"),  # a stream the client did not open
    f.settings({f.SETTINGS_MAX_FRAME_SIZE: 1}),
    f.settings({}) + f.window_update(0, f.MAX_WINDOW),  # a window above 2^31-1
    # A header block that never ends: refused past 64 KiB, not buffered without bound.
    f.settings({}) + f.frame(f.HEADERS, 0, 1, b"\x88")
    + f.frame(f.CONTINUATION, 0, 1, b"\0" * 16_000) * 5,
])
async def test_a_protocol_error_fails_the_call_and_the_next_call_reconnects(reply: bytes) -> None:
    answered: list[int] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not answered:  # the first connection misbehaves
            answered.append(1)
            received = b""
            while b"/t.S/M" not in received:  # the client's call is on the connection
                received += await reader.read(1000)
            writer.write(reply)
            await read_until_closed(reader)
            return
        await answer_each(reader, writer, [(GRPC, b"fine", [("grpc-status", "0")])])

    async with scripted(script) as (address, accepted):
        channel = Channel(address)
        error = await fails(channel)
        assert error.code in (StatusCode.INTERNAL, StatusCode.UNAVAILABLE), error
        assert await channel.unary("/t.S/M", b"", 10) == b"fine"
        assert accepted.connections == 2
        await channel.aclose()


async def test_a_connection_cut_mid_call_fails_every_call_in_flight() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = H2Peer(reader, writer)
        async for _ in peer.requests():
            if len(peer.open) == 3:  # all three calls in: cut
                writer.transport.abort()
                return

    async with scripted(script) as (address, _):
        channel = Channel(address)
        calls = [asyncio.ensure_future(channel.unary("/t.S/M", b"", 60)) for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), WAIT_S)
        assert all(isinstance(r, RpcError) and r.code is StatusCode.UNAVAILABLE
                   for r in results), results
        await channel.aclose()


async def test_calls_above_the_goaway_are_sent_again_on_a_new_connection() -> None:
    """The first connection takes calls 1, 3 and 5, answers 1, then says GOAWAY with last
    stream 1 and answers nothing more: 3 and 5 were never seen, and go to the next one."""
    connections: list[list[str]] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = H2Peer(reader, writer)
        seen: list[str] = []
        connections.append(seen)
        async for request in peer.requests():
            seen.append(bytes(request.body[5:]).decode())
            if len(connections) > 1:
                peer.answer(request, b"second:" + request.body[5:])
            elif len(seen) == 3:
                first = min(peer.open)
                peer.answer(peer.open[first], b"first:" + peer.open[first].body[5:])
                peer.conn.close_connection(last_stream_id=first)
                peer.flush()

    async with scripted(script) as (address, accepted):
        channel = Channel(address)
        answers = await asyncio.wait_for(asyncio.gather(
            *(channel.unary("/t.S/M", name.encode(), 30) for name in ("a", "b", "c"))), WAIT_S)
        assert answers == [b"first:a", b"second:b", b"second:c"]
        assert accepted.connections == 2
        await channel.aclose()


async def test_the_servers_stream_limit_frame_size_and_windows_are_kept() -> None:
    """One stream at a time, 16 KiB frames, 1,000-byte windows that the server widens only as
    it reads: ``h2`` raises (and the test fails) if the client sends beyond any of them; four
    concurrent calls of 50 KB each wait their turn and all get their answer."""
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        codes = h2.settings.SettingCodes
        peer = H2Peer(reader, writer, {codes.MAX_CONCURRENT_STREAMS: 1,
                                       codes.INITIAL_WINDOW_SIZE: 1000})
        async for request in peer.requests():
            peer.answer(request, str(len(request.body)).encode())
        assert peer.most_open == 1

    async with scripted(script) as (address, _):
        channel = Channel(address)
        requests = [bytes([i]) * 50_000 for i in range(4)]
        answers = await asyncio.wait_for(asyncio.gather(
            *(channel.unary("/t.S/M", r, 60) for r in requests)), WAIT_S)
        assert answers == [b"50005"] * 4
        await channel.aclose()


async def test_waiting_for_a_free_stream_ends_at_the_deadline() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = H2Peer(reader, writer, {h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1})
        async for _ in peer.requests():
            pass  # never answers

    async with scripted(script) as (address, _):
        channel = Channel(address)
        first = asyncio.ensure_future(channel.unary("/t.S/M", b"", 60))
        await until(lambda: channel._connection is not None
                    and channel._connection._max_streams == 1,
                    timeout_s=WAIT_S, what="the server's SETTINGS")
        error = await fails(channel, timeout_s=0.3)
        assert error.code is StatusCode.DEADLINE_EXCEEDED
        assert "free stream" in error.details
        first.cancel()
        await channel.aclose()


async def test_a_silent_server_is_given_up_after_an_unanswered_ping(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """It accepts and reads, and never sends a byte: the call misses its deadline, the
    client PINGs, and with no answer the connection is dropped; the next call reconnects."""
    monkeypatch.setattr(client_connection, "PROBE_TIMEOUT_S", 0.2)
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_until_closed(reader)

    async with scripted(silent) as (address, accepted):
        channel = Channel(address)
        assert (await fails(channel, timeout_s=0.2)).code is StatusCode.DEADLINE_EXCEEDED
        connection = channel._connection
        assert connection is not None
        await asyncio.wait_for(connection.done, WAIT_S)
        assert (await fails(channel, timeout_s=0.2)).code is StatusCode.DEADLINE_EXCEEDED
        assert accepted.connections == 2
        await channel.aclose()

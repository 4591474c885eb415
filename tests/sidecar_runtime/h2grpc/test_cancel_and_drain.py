"""Calls cut short: by the client (RST_STREAM, a grpcio cancel), by ``grpc-timeout``, and by the
server's drain (``stop(grace)``: GOAWAY, calls in flight finish within grace, new ones refused,
the rest cut)."""

from __future__ import annotations

import asyncio

import grpc
import h2.errors
import pytest
from hyperframe.frame import (
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from tests.harness.waits import until
from tests.sidecar_runtime.h2grpc.clients import (
    FrameClient,
    H2Client,
    grpc_headers,
    message,
    messages,
)
from tests.sidecar_runtime.h2grpc.servicers import channel, path, pattern, running_server, unary

DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


async def test_client_reset_cancels_the_handler_and_the_connection_serves_on() -> None:
    async with running_server() as running:
        seen = running.servicer.seen
        client = await H2Client.open(running.port)
        stream = client.request(path("Hold"), message(b"x"))
        await until(seen.started.is_set, timeout_s=5, what="the handler to start")
        client.conn.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
        client.flush()
        await until(seen.ended.is_set, timeout_s=5, what="the handler to end")
        assert seen.cancelled == 1
        # Frames a client still had in flight for the stream it reset.
        client.writer.write(DataFrame(stream, message(b"late")).serialize()
                            + WindowUpdateFrame(stream, 1000).serialize()
                            + RstStreamFrame(stream, 8).serialize())
        answer = await client.call(path("Echo"), b"still here")
        assert messages(answer.body) == [b"still here"]
        assert client.terminated is None
        await client.close()


async def test_grpcio_cancel_cancels_the_handler() -> None:
    async with running_server() as running, channel(running.address) as ch:
        seen = running.servicer.seen
        call = ch.unary_unary(path("Hold"))(b"x")
        await until(seen.started.is_set, timeout_s=5, what="the handler to start")
        call.cancel()
        await until(seen.ended.is_set, timeout_s=5, what="the handler to end")
        assert seen.cancelled == 1
        assert await unary(ch, "Echo", b"next") == b"next"


async def test_grpcio_cancel_mid_bidi_stream_cancels_the_handler() -> None:
    async with running_server() as running, channel(running.address) as ch:
        seen = running.servicer.seen
        call = ch.stream_stream(path("HoldStream"))()
        await call.write(b"one")
        assert await call.read() == b"one"
        call.cancel()
        await until(seen.ended.is_set, timeout_s=5, what="the handler to end")
        assert seen.cancelled == 1


async def test_grpc_timeout_expiry_is_deadline_exceeded_and_cancels_the_handler() -> None:
    async with running_server() as running:
        seen = running.servicer.seen
        client = await H2Client.open(running.port)
        stream = client.request("", message(b"x"),
                                headers=grpc_headers(path("Hold"), grpc_timeout="100m"))
        answer = await client.answer(stream)
        assert answer.grpc_status == DEADLINE_EXCEEDED
        await until(seen.ended.is_set, timeout_s=5, what="the handler to end")
        assert seen.cancelled == 1
        assert seen.deadline is not None and 0 < seen.deadline <= 0.1
        await client.close()


async def test_grpcio_deadline_cancels_the_handler() -> None:
    async with running_server() as running, channel(running.address) as ch:
        seen = running.servicer.seen
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            await unary(ch, "Hold", b"x", timeout=0.2)
        assert expired.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await until(seen.ended.is_set, timeout_s=5, what="the handler to end")
        assert seen.cancelled == 1


async def test_deadline_passes_before_the_request_message_arrives() -> None:
    """A unary call whose message never comes still ends at its deadline: it does not hold a
    stream (and its memory) until the connection closes."""
    async with running_server() as running:
        client = await H2Client.open(running.port)
        stream = client.request("", None, end=False,
                                headers=grpc_headers(path("Echo"), grpc_timeout="50m"))
        answer = await client.answer(stream)
        assert answer.grpc_status == DEADLINE_EXCEEDED
        # A message arriving after that is not handled.
        client.writer.write(DataFrame(stream, message(b"late"), flags=["END_STREAM"]).serialize())
        assert messages((await client.call(path("Echo"), b"next")).body) == [b"next"]
        assert running.servicer.seen.requests == [b"next"]
        await client.close()


@pytest.mark.parametrize("value", ["1x", "S", "123456789S", "-1S", "1.5S", "\u00b2S", "\uff11S"])
async def test_malformed_grpc_timeout_is_ignored(value: str) -> None:
    async with running_server() as running:
        client = await H2Client.open(running.port)
        stream = client.request("", message(b"x"),
                                headers=grpc_headers(path("Echo"), grpc_timeout=value))
        answer = await client.answer(stream)
        assert answer.grpc_status == 0
        await client.close()


def _ended(frame: object, stream: int) -> bool:
    return isinstance(frame, HeadersFrame) and frame.stream_id == stream \
        and "END_STREAM" in frame.flags


async def test_drain_answers_calls_in_flight_and_refuses_new_streams() -> None:
    async with running_server() as running:
        seen = running.servicer.seen
        client = await FrameClient.open(running.port)
        client.send(client.headers(1, grpc_headers(path("Hold"))),
                    DataFrame(1, message(b"in flight"), flags=["END_STREAM"]))
        await until(seen.started.is_set, timeout_s=5, what="the handler to start")
        stopping = asyncio.create_task(running.server.stop(30.0))
        goaway = await client.until(lambda frame: isinstance(frame, GoAwayFrame))
        assert isinstance(goaway, GoAwayFrame)
        assert (goaway.error_code, goaway.last_stream_id) == (0, 1)
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", running.port)
        # A stream opened after GOAWAY is refused: the client may retry it elsewhere.
        client.send(client.headers(3, grpc_headers(path("Echo"))),
                    DataFrame(3, message(b"new"), flags=["END_STREAM"]))
        refused = await client.until(lambda frame: isinstance(frame, RstStreamFrame))
        assert isinstance(refused, RstStreamFrame)
        assert (refused.stream_id, refused.error_code) == (3, 7)  # REFUSED_STREAM
        seen.release.set()
        body = bytearray()
        while not _ended(frame := await client.until(lambda f: f.stream_id == 1), 1):
            if isinstance(frame, DataFrame):
                body += frame.data
        assert isinstance(frame, HeadersFrame)
        assert client.decode(frame)["grpc-status"] == "0"
        assert messages(bytes(body)) == [b"in flight"]
        await stopping
        assert await client.until_closed() == []
        assert seen.cancelled == 0
        await client.close()


async def test_drain_cuts_calls_running_past_grace() -> None:
    async with running_server() as running:
        seen = running.servicer.seen
        client = await FrameClient.open(running.port)
        client.send(client.headers(1, grpc_headers(path("Hold"))),
                    DataFrame(1, message(b"x"), flags=["END_STREAM"]))
        await until(seen.started.is_set, timeout_s=5, what="the handler to start")
        await running.server.stop(0.05)
        assert seen.ended.is_set()
        assert seen.cancelled == 1
        frames = await client.until_closed()
        assert not any(_ended(frame, 1) for frame in frames), frames
        assert any(isinstance(frame, GoAwayFrame) for frame in frames)
        await client.close()


async def test_drain_with_grpcio_call_in_flight() -> None:
    async with running_server() as running, channel(running.address) as ch:
        seen = running.servicer.seen
        call = ch.unary_unary(path("Hold"))(b"grpcio")
        await until(seen.started.is_set, timeout_s=5, what="the handler to start")
        stopping = asyncio.create_task(running.server.stop(30.0))
        await until(lambda: running.server._stopped, timeout_s=5, what="the stop to begin")
        seen.release.set()
        assert await call == b"grpcio"
        await stopping


async def test_drain_delivers_an_answer_still_waiting_for_the_clients_window() -> None:
    # The handler is done, but its answer waits for window the client has not granted yet: the
    # drain waits for it (within grace) instead of closing the connection on it. (Raw frames:
    # h2's client refuses to send WINDOW_UPDATE once it has received GOAWAY.)
    async with running_server() as running:
        client = await FrameClient.open(running.port)  # default windows: 65,535 bytes
        client.send(client.headers(1, grpc_headers(path("Big"))),
                    DataFrame(1, message(b"200000"), flags=["END_STREAM"]))
        body = bytearray()
        while len(body) < 65_535:
            frame = await client.until(lambda f: isinstance(f, DataFrame) and f.stream_id == 1)
            assert isinstance(frame, DataFrame)
            body += frame.data
        stopping = asyncio.ensure_future(running.server.stop(10))
        await client.until(lambda f: isinstance(f, GoAwayFrame))
        assert not stopping.done()
        client.send(WindowUpdateFrame(0, window_increment=1_000_000),
                    WindowUpdateFrame(1, window_increment=1_000_000))
        frames = await client.until_closed()
        body += b"".join(f.data for f in frames if isinstance(f, DataFrame) and f.stream_id == 1)
        assert messages(bytes(body)) == [pattern(200_000)]
        assert any(_ended(frame, 1) for frame in frames)
        await asyncio.wait_for(stopping, 5)  # and the server is done well before its grace
        await client.close()


async def test_streams_reset_in_the_read_that_opened_them_do_not_hold_the_drain() -> None:
    # HEADERS (and the message) then RST_STREAM in one read: the handler's task is cancelled
    # before its first step, so nothing inside it runs, its end included. The server still
    # counts the call as done: the drain ends as soon as the connection has nothing in flight.
    async with running_server() as running:
        client = await FrameClient.open(running.port)
        client.send(client.headers(1, grpc_headers(path("Hold"))),
                    DataFrame(1, message(b"x"), flags=["END_STREAM"]), RstStreamFrame(1, 8),
                    client.headers(3, grpc_headers(path("Chat"))), RstStreamFrame(3, 8),
                    client.headers(5, grpc_headers(path("Echo"))),
                    DataFrame(5, message(b"after"), flags=["END_STREAM"]))
        await client.until(lambda frame: _ended(frame, 5))
        stopping = asyncio.ensure_future(running.server.stop(30))
        frames = await client.until_closed()
        assert any(isinstance(frame, GoAwayFrame) for frame in frames)
        await asyncio.wait_for(stopping, 5)  # well before its grace
        assert not running.servicer.seen.started.is_set()
        await client.close()


async def test_drain_ends_when_the_client_resets_an_answer_waiting_for_its_window() -> None:
    # The handler is done, its answer waits for window; the client resets that stream (its own
    # timeout, say) instead of granting any: nothing is left, the connection closes at once.
    async with running_server() as running:
        client = await FrameClient.open(running.port)  # default windows: 65,535 bytes
        client.send(client.headers(1, grpc_headers(path("Big"))),
                    DataFrame(1, message(b"200000"), flags=["END_STREAM"]))
        sent = 0
        while sent < 65_535:
            frame = await client.until(lambda f: isinstance(f, DataFrame) and f.stream_id == 1)
            assert isinstance(frame, DataFrame)
            sent += len(frame.data)
        stopping = asyncio.ensure_future(running.server.stop(30))
        await client.until(lambda f: isinstance(f, GoAwayFrame))
        client.send(RstStreamFrame(1, 8))
        assert await client.until_closed() == []
        await asyncio.wait_for(stopping, 5)  # well before its grace
        await client.close()


async def test_drain_waits_for_the_message_of_a_unary_call_it_accepted() -> None:
    # A unary call's HEADERS read, its message not yet (the next TCP segment): its handler has
    # not started, but GOAWAY names the stream as taken, so the client will not retry it
    # elsewhere. The drain waits for the message and answers it instead of closing on it.
    async with running_server() as running:
        client = await FrameClient.open(running.port)
        client.send(client.headers(1, grpc_headers(path("Echo"))), PingFrame(0, b"headers!"))
        await client.until(lambda frame: isinstance(frame, PingFrame))  # HEADERS were read
        stopping = asyncio.ensure_future(running.server.stop(30))
        goaway = await client.until(lambda frame: isinstance(frame, GoAwayFrame))
        assert isinstance(goaway, GoAwayFrame) and goaway.last_stream_id == 1
        client.send(DataFrame(1, message(b"second segment"), flags=["END_STREAM"]))
        frames = await client.until_closed()
        body = b"".join(f.data for f in frames if isinstance(f, DataFrame) and f.stream_id == 1)
        assert messages(body) == [b"second segment"]
        assert any(_ended(frame, 1) for frame in frames)
        await asyncio.wait_for(stopping, 5)
        await client.close()


async def test_a_stream_the_client_opened_as_the_goaway_left_is_refused_not_reset() -> None:
    # An idle connection is read for a moment after its GOAWAY: a HEADERS already on its way
    # gets REFUSED_STREAM (retriable), rather than the kernel's reset of a connection closed
    # with unread data, which can take the GOAWAY with it.
    async with running_server() as running:
        client = await FrameClient.open(running.port)
        await client.until(lambda f: isinstance(f, SettingsFrame))  # the connection is up
        stopping = asyncio.ensure_future(running.server.stop(5))
        await client.until(lambda f: isinstance(f, GoAwayFrame))
        client.send(client.headers(1, grpc_headers(path("Echo"))),
                    DataFrame(1, message(b"late"), flags=["END_STREAM"]))
        refused = await client.until(lambda f: isinstance(f, RstStreamFrame))
        assert isinstance(refused, RstStreamFrame)
        assert (refused.stream_id, refused.error_code) == (1, h2.errors.ErrorCodes.REFUSED_STREAM)
        assert await client.until_closed() == []
        await asyncio.wait_for(stopping, 5)
        await client.close()

"""Flow control both ways, through ``h2``'s client state machine: it raises (FlowControlError,
FrameTooLargeError) if the server ever sends beyond a window or above the client's maximum frame
size, so every answer that arrives whole here is also an answer sent within the rules."""

from __future__ import annotations

import asyncio

import grpc
import h2.errors
import h2.settings
from hyperframe.frame import DataFrame, HeadersFrame, RstStreamFrame, SettingsFrame

from tests.harness.waits import until
from tests.sidecar_runtime.h2grpc.clients import (
    FrameClient,
    H2Client,
    grpc_headers,
    message,
    messages,
)
from tests.sidecar_runtime.h2grpc.servicers import channel, path, pattern, running_server, unary

TEN_MB = 10 * 1024 * 1024
BIG_LIMIT = 16 * 1024 * 1024


async def test_ten_megabytes_each_way_through_small_windows() -> None:
    """A 10 MB request (above the server's 4 MB stream window: it must top it up) echoed back
    to a client whose windows are 64 KiB, granted back one frame at a time."""
    request = pattern(TEN_MB)
    async with running_server(max_receive=BIG_LIMIT) as running:
        client = await H2Client.open(running.port, window=65_535, max_frame=16_384)
        answer = await client.call(path("Echo"), request)
        assert answer.grpc_status == 0, answer
        assert messages(answer.body) == [request]
        await client.close()


async def test_large_answers_on_many_streams_share_the_connection_window() -> None:
    sizes = [300_000 + i for i in range(6)]
    async with running_server() as running:
        client = await H2Client.open(running.port, window=65_535, max_frame=16_384)
        streams = [client.request(path("Big"), message(str(size).encode())) for size in sizes]
        await client.until(lambda: all(client.answers[s].done for s in streams))
        for stream, size in zip(streams, sizes, strict=True):
            assert client.answers[stream].grpc_status == 0
            assert messages(client.answers[stream].body) == [pattern(size)]
        await client.close()


async def test_server_waits_for_window_then_resumes() -> None:
    """With no window granted back, the server sends exactly the client's 64 KiB window and
    holds the rest (the trailers too); a WINDOW_UPDATE lets the rest out."""
    async with running_server() as running:
        client = await H2Client.open(running.port, window=65_535)
        client.grant = False
        stream = client.request(path("Big"), message(b"200000"))
        answer = client.answers[stream]
        await client.until(lambda: len(answer.body) == 65_535)
        # A unary call on the same connection while the first is blocked: its answer needs
        # connection window too, so it waits behind; the connection itself stays responsive.
        client.conn.ping(b"12345678")
        client.flush()
        await client.until(lambda: client.pings)
        assert not answer.done
        client.grant = True
        client.conn.increment_flow_control_window(200_005 - 65_535)
        client.conn.increment_flow_control_window(200_005 - 65_535, stream_id=stream)
        client.flush()
        await client.answer(stream)
        assert answer.grpc_status == 0
        assert messages(answer.body) == [pattern(200_000)]
        await client.close()


async def test_initial_window_size_change_applies_to_open_streams() -> None:
    """SETTINGS_INITIAL_WINDOW_SIZE lowered to 0 mid-answer stops the server on open streams
    (the windows go to or below zero); raised again, it resumes them."""
    async with running_server() as running:
        client = await H2Client.open(running.port, window=65_535)
        client.grant = False
        stream = client.request(path("Big"), message(b"500000"))
        answer = client.answers[stream]
        await client.until(lambda: len(answer.body) == 65_535)
        client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        client.flush()
        await client.until(lambda: client.conn.local_settings.initial_window_size == 0)
        # Grant connection window: only the (now negative) stream window holds the answer.
        client.conn.increment_flow_control_window(1_000_000)
        client.flush()
        client.conn.ping(b"abcdefgh")
        client.flush()
        await client.until(lambda: client.pings)
        assert len(answer.body) == 65_535
        client.grant = True
        client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1_000_000})
        client.flush()
        await client.answer(stream)
        assert messages(answer.body) == [pattern(500_000)]
        await client.close()


async def test_ten_megabytes_each_way_with_grpcio() -> None:
    request = pattern(TEN_MB)
    options = [("grpc.max_receive_message_length", BIG_LIMIT),
               ("grpc.max_send_message_length", BIG_LIMIT)]
    async with running_server(max_receive=BIG_LIMIT) as running, \
            channel(running.address, options) as ch:
        assert await unary(ch, "Echo", request) == request


async def test_hundreds_of_concurrent_calls_on_one_connection() -> None:
    """300 unary calls in flight at once on one channel (the handler answers only once all
    300 wait in it), every one answered."""
    count = 300
    async with running_server(max_streams=count) as running, channel(running.address) as ch:
        running.servicer.gate_at = count
        answers = await asyncio.gather(
            *(unary(ch, "Gate", str(i).encode()) for i in range(count)))
        assert answers == [str(i).encode() for i in range(count)]
        assert running.servicer.seen.in_flight == count


async def test_many_streams_in_one_read_are_all_answered() -> None:
    """Hundreds of HEADERS+DATA in one write (one read on the server) and a bidi stream
    among them: every stream gets its own answer."""
    async with running_server(max_streams=301) as running:
        client = await H2Client.open(running.port)
        streams = [client.request(path("Echo"), message(str(i).encode())) for i in range(300)]
        chat = client.request(path("Chat"), message(b"a") + message(b"b"))
        await client.until(lambda: all(client.answers[s].done for s in [*streams, chat]))
        for i, stream in enumerate(streams):
            assert messages(client.answers[stream].body) == [str(i).encode()]
        assert messages(client.answers[chat].body) == [b"A", b"B"]
        assert client.answers[chat].grpc_status == grpc.StatusCode.OK.value[0]
        await client.close()


async def test_a_handler_that_does_not_read_holds_the_client_back() -> None:
    """The stream window is granted back as the handler takes messages, not as they arrive:
    a client streaming to a handler that reads nothing stops at the window (here 4 MiB), it
    cannot pile up messages in the server's memory."""
    chunk = message(b"m" * 65_531)  # 64 KiB a message
    window = 4 * 1024 * 1024  # the server's SETTINGS_INITIAL_WINDOW_SIZE
    count = 3 * window // len(chunk)
    async with running_server() as running:
        seen = running.servicer.seen
        client = await H2Client.open(running.port)
        stream = client.request(path("Stall"), b"", end=False)
        await until(seen.started.is_set, timeout_s=5, what="the handler to start")
        client.send(stream, chunk * count, end=True)
        await client.until(lambda: client.sent[stream] == window)
        # Any WINDOW_UPDATE the server sends for that data comes before the PING's ACK (and
        # the client would spend it at once).
        client.conn.ping(b"in order")
        client.flush()
        await client.until(lambda: client.pings)
        assert client.sent[stream] == window
        seen.release.set()
        answer = await client.answer(stream)
        assert messages(answer.body) == [str(count).encode()]
        await client.close()


async def test_streams_beyond_the_advertised_limit_are_refused_and_the_rest_served() -> None:
    """The server advertises its limit of streams per connection in SETTINGS; a client that
    opens more anyway (here before reading the SETTINGS) has the extra ones refused with
    REFUSED_STREAM, which it may retry, while the others are answered, and a stream opened
    once they are done is served."""
    limit = 3
    async with running_server(max_streams=limit) as running:
        client = await FrameClient.open(running.port)
        for stream in (1, 3, 5, 7, 9):  # Hold: each waits until the test releases them
            client.send(client.headers(stream, grpc_headers(path("Hold"))),
                        DataFrame(stream, message(b"x"), flags=["END_STREAM"]))
        settings = await client.until(lambda f: isinstance(f, SettingsFrame)
                                      and "ACK" not in f.flags)
        assert isinstance(settings, SettingsFrame)
        assert settings.settings[SettingsFrame.MAX_CONCURRENT_STREAMS] == limit
        refused: set[int] = set()
        while len(refused) < 2:
            frame = await client.read_frame()
            assert frame is not None
            if isinstance(frame, RstStreamFrame):
                assert frame.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
                refused.add(frame.stream_id)
        assert refused == {7, 9}
        assert running.servicer.seen.in_flight == limit
        running.servicer.seen.release.set()
        ended: set[int] = set()
        while ended != {1, 3, 5}:
            frame = await client.read_frame()
            assert frame is not None and not isinstance(frame, RstStreamFrame)
            if isinstance(frame, HeadersFrame) and "END_STREAM" in frame.flags:
                ended.add(frame.stream_id)
        client.send(client.headers(11, grpc_headers(path("Echo"))),
                    DataFrame(11, message(b"later"), flags=["END_STREAM"]))
        answer = await client.until(lambda f: isinstance(f, DataFrame) and f.stream_id == 11)
        assert isinstance(answer, DataFrame)
        assert messages(answer.data) == [b"later"]
        await client.close()


async def test_a_grpcio_client_keeps_to_the_limit_and_every_call_is_answered() -> None:
    """A real client reads the limit and queues its calls instead of opening more streams:
    40 concurrent calls on a server allowing 4 per connection all succeed."""
    async with running_server(max_streams=4) as running, channel(running.address) as ch:
        answers = await asyncio.gather(*(unary(ch, "Echo", str(i).encode()) for i in range(40)))
        assert answers == [str(i).encode() for i in range(40)]

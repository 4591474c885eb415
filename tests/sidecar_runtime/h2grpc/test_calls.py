"""The h2grpc server as a gRPC client sees it (grpcio's ``grpc.aio`` channel): unary, server
streaming, bidi streaming, ``context.read``/``context.write``, and every status a call can end
with, details included."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.sidecar_runtime.h2grpc.clients import H2Client, grpc_headers, message, messages
from tests.sidecar_runtime.h2grpc.servicers import (
    MAX_RECEIVE,
    SERVICE,
    channel,
    path,
    running_server,
    unary,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_unary_echoes_with_metadata() -> None:
    async with running_server() as running, channel(running.address) as ch:
        answer = await unary(ch, "Echo", b"hello", metadata=(("x-who", "me"),))
        assert answer == b"hello"
        assert ("x-who", "me") in running.servicer.seen.metadata
        # An empty message is a message too.
        assert await unary(ch, "Echo", b"") == b""
        # A message exactly at the limit passes.
        assert len(await unary(ch, "Echo", b"a" * MAX_RECEIVE)) == MAX_RECEIVE


async def test_health_check_and_watch_pushes_a_change() -> None:
    async with running_server() as running, channel(running.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        await running.health.set(SERVICE, SERVING)
        checked = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert checked.status == SERVING
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
        assert (await watch.read()).status == SERVING
        await running.health.set(SERVICE, NOT_SERVING)
        assert (await watch.read()).status == NOT_SERVING
        watch.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert missing.value.code() is grpc.StatusCode.NOT_FOUND


async def test_bidi_many_messages_each_way() -> None:
    count = 2000

    async def requests() -> AsyncIterator[bytes]:
        for i in range(count):
            yield f"m{i}".encode()

    async with running_server() as running, channel(running.address) as ch:
        call = ch.stream_stream(path("Chat"))(requests())
        answers = [answer async for answer in call]
        assert answers == [f"M{i}".encode() for i in range(count)]
        assert await call.code() is grpc.StatusCode.OK


async def test_server_streaming_from_a_plain_generator() -> None:
    # grpc.aio serves a handler written as a plain (sync) generator; this server must not end
    # such a call with OK and no message at all.
    async with running_server() as running, channel(running.address) as ch:
        call = ch.unary_stream(path("Count"))(b"3")
        assert [answer async for answer in call] == [b"0", b"1", b"2"]
        assert await call.code() is grpc.StatusCode.OK


async def test_bidi_interleaved_read_and_write() -> None:
    """Each answer arrives before the next request is sent: the handler's messages are not
    held back until the client half-closes."""
    async with running_server() as running, channel(running.address) as ch:
        call = ch.stream_stream(path("ReadWrite"))()
        for i in range(100):
            await call.write(f"abc{i}".encode())
            assert await call.read() == f"abc{i}".encode()[::-1]
        await call.done_writing()
        assert await call.read() == b"100"
        assert await call.read() is grpc.aio.EOF
        assert await call.code() is grpc.StatusCode.OK


async def test_protobuf_request_and_answer() -> None:
    async with running_server() as running, channel(running.address) as ch:
        method = ch.unary_unary(
            path("Parse"), request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        assert (await method(health_pb2.HealthCheckRequest(service="up"))).status == SERVING


async def _status(ch: grpc.aio.Channel, method: str, request: bytes,
                  **kwargs: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await unary(ch, method, request, **kwargs)
    return failed.value


async def test_abort_details_round_trip_percent_encoding() -> None:
    details = "refusé: 100% sûr ✓ %41 %%, tab\there\r\nnew line 日本"
    async with running_server() as running, channel(running.address) as ch:
        error = await _status(ch, "Abort", details.encode())
        assert error.code() is grpc.StatusCode.PERMISSION_DENIED
        assert error.details() == details


async def test_unknown_method_is_unimplemented() -> None:
    async with running_server() as running, channel(running.address) as ch:
        error = await _status(ch, "NoSuchMethod", b"x")
        assert error.code() is grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.aio.AioRpcError) as other:
            await ch.unary_unary("/other.Service/Echo")(b"x")
        assert other.value.code() is grpc.StatusCode.UNIMPLEMENTED


async def test_handler_exception_is_unknown_without_its_text() -> None:
    async with running_server() as running, channel(running.address) as ch:
        error = await _status(ch, "Fail", b"x")
        assert error.code() is grpc.StatusCode.UNKNOWN
        assert "hunter2" not in (error.details() or "")
        assert "secret" not in (error.details() or "")
        # The connection serves on.
        assert await unary(ch, "Echo", b"after") == b"after"


async def test_request_that_does_not_parse_is_internal() -> None:
    async with running_server() as running, channel(running.address) as ch:
        error = await _status(ch, "Parse", b"\xff\xff\xff")
        assert error.code() is grpc.StatusCode.INTERNAL


async def test_message_above_limit_is_resource_exhausted() -> None:
    async with running_server() as running, channel(running.address) as ch:
        error = await _status(ch, "Echo", b"a" * (MAX_RECEIVE + 1))
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await unary(ch, "Echo", b"after") == b"after"


async def test_declared_length_above_limit_is_refused_before_the_body() -> None:
    """The limit holds on the length prefix: a client that declares 4 GiB and sends nothing
    more is answered at once, nothing buffered."""
    async with running_server() as running:
        client = await H2Client.open(running.port)
        stream = client.request(path("Echo"), b"\0\xff\xff\xff\xff", end=False)
        answer = await client.answer(stream)
        assert answer.grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        # The same limit on a bidi stream, in the second message.
        stream = client.request(path("Chat"), message(b"ok"), end=False)
        answer = client.answers[stream]
        await client.until(lambda: answer.body)
        client.send(stream, b"\0\x00\x10\x00\x01")
        await client.answer(stream)
        assert messages(answer.body) == [b"OK"]
        assert answer.grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        await client.close()


async def test_compressed_message_is_unimplemented() -> None:
    async with running_server() as running, channel(running.address) as ch:
        error = await _status(ch, "Echo", b"a" * 1000, compression=grpc.Compression.Gzip)
        assert error.code() is grpc.StatusCode.UNIMPLEMENTED
        client = await H2Client.open(running.port)
        answer = await client.answer(client.request(path("Echo"), message(b"x", True)))
        assert answer.grpc_status == grpc.StatusCode.UNIMPLEMENTED.value[0]
        await client.close()


async def test_unary_without_a_message_is_internal() -> None:
    async with running_server() as running:
        client = await H2Client.open(running.port)
        answer = await client.answer(client.request(path("Echo"), None))
        assert answer.grpc_status == grpc.StatusCode.INTERNAL.value[0]
        await client.close()


@pytest.mark.parametrize(("method", "content_type", "status"), [
    ("GET", "application/grpc", "405"),
    ("PUT", "application/grpc", "405"),
    ("POST", "application/json", "415"),
    ("POST", "text/plain", "415"),
])
async def test_not_a_grpc_request_is_refused_by_http_status(
        method: str, content_type: str, status: str) -> None:
    async with running_server() as running:
        client = await H2Client.open(running.port)
        headers = [(name, method if name == ":method" else
                    content_type if name == "content-type" else value)
                   for name, value in grpc_headers(path("Echo"))]
        answer = await client.answer(client.request("", message(b"x"), headers=headers))
        assert answer.headers[":status"] == status
        assert answer.grpc_status is None
        assert running.servicer.seen.metadata == []  # the handler never ran
        # The connection serves on.
        assert messages((await client.call(path("Echo"), b"y")).body) == [b"y"]
        await client.close()


async def test_grpc_content_type_variants_are_accepted() -> None:
    async with running_server() as running:
        client = await H2Client.open(running.port)
        for content_type in ("application/grpc+proto", "application/grpc;charset=utf-8"):
            headers = [(name, content_type if name == "content-type" else value)
                       for name, value in grpc_headers(path("Echo"))]
            answer = await client.answer(client.request("", message(b"x"), headers=headers))
            assert answer.grpc_status == 0, content_type
        await client.close()

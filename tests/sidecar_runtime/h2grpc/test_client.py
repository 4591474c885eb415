"""The gRPC client channel against real servers: ours (the test servicer, and the rate-limit
servicer the services run) and grpcio's aio server (a third-party server): answers and
statuses, calls multiplexed on one connection, messages larger than the windows, deadlines,
TLS and mutual TLS, a Unix socket, a server down, restarted, or draining."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit.service import RateLimitService, RateLimitServicer
from sidecar_runtime.h2grpc import Server, tls_context
from sidecar_runtime.h2grpc.client import Channel, tls_client_context
from sidecar_runtime.h2grpc.status import RpcError, StatusCode
from sidecar_runtime.process.settings import Settings
from tests.harness.tls import TlsFiles, make_tls_files
from tests.harness.waits import until
from tests.sidecar_runtime.h2grpc.servicers import (
    Servicer,
    path,
    pattern,
    register,
    running_server,
)

RLS = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
YAML = """
version: 1
clusters: {pool: {endpoints: ["127.0.0.1:9"], max_context: 4096}}
models: {m: {clusters: [pool]}}
rate_limits:
  tenant: {default: {requests: 2/min}}
"""


@pytest.fixture(autouse=True)
async def loop_errors() -> AsyncIterator[list[dict[str, object]]]:
    """Whatever a test does to the client, nothing escapes into the event loop."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    yield errors
    loop.set_exception_handler(None)
    assert errors == []


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture
async def grpcio_server() -> AsyncIterator[tuple[str, Servicer]]:
    """grpcio's aio server with the test servicer (its handlers take any context)."""
    server = grpc.aio.server()
    servicer = Servicer()
    register(server, servicer)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        servicer.seen.release.set()
        await server.stop(0.5)


def rls_request(tenant: str) -> rls_pb2.RateLimitRequest:
    entry = ratelimit_pb2.RateLimitDescriptor.Entry
    return rls_pb2.RateLimitRequest(domain="llm-sidecar", descriptors=[
        ratelimit_pb2.RateLimitDescriptor(entries=[entry(key="kind", value="requests"),
                                                   entry(key="tenant", value=tenant)])])


async def rls_codes(channel: Channel, tenant: str, calls: int) -> list[int]:
    answers = [await channel.unary_unary(RLS, rls_request(tenant),
                                         rls_pb2.RateLimitResponse.FromString, 5)
               for _ in range(calls)]
    return [answer.overall_code for answer in answers]


@pytest.mark.parametrize("server_kind", ["h2grpc", "grpcio"])
async def test_the_rate_limit_servicer_answers_through_the_client(
        server_kind: str, tmp_path: Path) -> None:
    config = tmp_path / "routing.yaml"
    config.write_text(YAML)
    service = RateLimitService(str(config), Settings())
    server: Server | grpc.aio.Server = Server() if server_kind == "h2grpc" else grpc.aio.server()
    RateLimitServicer(service.limiter).register(server)
    port = await server.add_port("127.0.0.1:0") if isinstance(server, Server) \
        else server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = Channel(f"127.0.0.1:{port}")
    try:
        over = rls_pb2.RateLimitResponse.OVER_LIMIT
        ok = rls_pb2.RateLimitResponse.OK
        assert await rls_codes(channel, "t1", 3) == [ok, ok, over]
        too_many = rls_pb2.RateLimitRequest(domain="llm-sidecar", descriptors=[
            rls_request("t2").descriptors[0]] * 1025)
        with pytest.raises(RpcError) as refused:  # the servicer's abort, through the wire
            await channel.unary_unary(RLS, too_many, rls_pb2.RateLimitResponse.FromString, 5)
        assert refused.value.code is StatusCode.INVALID_ARGUMENT
        assert refused.value.details == \
            "the request exceeds the bound of 1,024 descriptors per request"
    finally:
        await channel.aclose()
        await server.stop(0.5)
        await service.close()


async def test_statuses_and_messages_from_our_server() -> None:
    async with running_server() as running:
        channel = Channel(running.address)
        assert await channel.unary(path("Echo"), b"hello", 5) == b"hello"
        with pytest.raises(RpcError) as aborted:
            await channel.unary(path("Abort"), "naïve 100% \n done".encode(), 5)
        assert aborted.value.code is StatusCode.PERMISSION_DENIED
        assert aborted.value.details == "naïve 100% \n done"  # percent-decoded
        with pytest.raises(RpcError) as missing:
            await channel.unary(path("Missing"), b"", 5)
        assert missing.value.code is StatusCode.UNIMPLEMENTED  # trailers-only
        with pytest.raises(RpcError) as failed:
            await channel.unary(path("Fail"), b"", 5)
        assert (failed.value.code, failed.value.details) == (StatusCode.UNKNOWN,
                                                             "Unexpected error")
        assert await channel.unary(path("Echo"), b"", 5) == b""  # an empty message
        await channel.aclose()


@pytest.mark.parametrize("server_kind", ["h2grpc", "grpcio"])
async def test_concurrent_calls_share_one_connection(
        server_kind: str, grpcio_server: tuple[str, Servicer]) -> None:
    """Gate answers only once all 40 calls wait in it at the same time: they are multiplexed,
    not queued; and the server saw one connection."""
    async with running_server() as running:
        address, servicer = (running.address, running.servicer) if server_kind == "h2grpc" \
            else grpcio_server
        servicer.gate_at = 40
        channel = Channel(address)
        answers = await asyncio.gather(*(channel.unary(path("Gate"), str(i).encode(), 30)
                                         for i in range(40)))
        assert answers == [str(i).encode() for i in range(40)]
        if server_kind == "h2grpc":
            assert len(running.server._connections) == 1
        await channel.aclose()


@pytest.mark.parametrize("server_kind", ["h2grpc", "grpcio"])
async def test_messages_larger_than_the_windows(
        server_kind: str, grpcio_server: tuple[str, Servicer]) -> None:
    """A 300 KB request through the server's windows (grpcio starts at 64 KiB), and a 1 MB
    answer through a client window of 64 KiB: the client grants as it reads."""
    async with running_server() as running:
        address = running.address if server_kind == "h2grpc" else grpcio_server[0]
        channel = Channel(address, receive_window=65_535)
        request = pattern(300_000)
        assert await channel.unary(path("Echo"), request, 30) == request
        assert await channel.unary(path("Big"), b"1000000", 30) == pattern(1_000_000)
        results = await asyncio.gather(*(channel.unary(path("Big"), str(n).encode(), 30)
                                         for n in (70_000, 200_000, 5)))
        assert results == [pattern(70_000), pattern(200_000), pattern(5)]
        await channel.aclose()


async def test_an_answer_above_the_limit_is_refused() -> None:
    async with running_server() as running:
        channel = Channel(running.address, max_receive_message_length=100_000)
        with pytest.raises(RpcError) as refused:
            await channel.unary(path("Big"), b"100001", 30)
        assert refused.value.code is StatusCode.RESOURCE_EXHAUSTED
        assert await channel.unary(path("Big"), b"100000", 30) == pattern(100_000)
        await channel.aclose()


@pytest.mark.parametrize("server_kind", ["h2grpc", "grpcio"])
async def test_a_deadline_cancels_the_call_and_the_connection_serves_on(
        server_kind: str, grpcio_server: tuple[str, Servicer]) -> None:
    async with running_server() as running:
        address, servicer = (running.address, running.servicer) if server_kind == "h2grpc" \
            else grpcio_server
        channel = Channel(address)
        assert await channel.unary(path("Echo"), b"warm", 5) == b"warm"
        connection = channel._connection
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(RpcError) as expired:
            await channel.unary(path("Hold"), b"x", 0.3)  # the handler never answers
        assert expired.value.code is StatusCode.DEADLINE_EXCEEDED
        assert loop.time() - started >= 0.3  # not before the deadline
        seen = servicer.seen
        assert seen.deadline is not None and seen.deadline <= 0.3  # grpc-timeout was sent
        await until(seen.ended.is_set, timeout_s=10, what="the handler to be cancelled")
        assert seen.cancelled == 1
        assert await channel.unary(path("Echo"), b"after", 5) == b"after"
        assert channel._connection is connection
        await channel.aclose()


@pytest.mark.parametrize("mutual", [False, True])
async def test_tls(tls_files: TlsFiles, mutual: bool) -> None:
    files = tls_files
    server_tls = tls_context(str(files.server_cert), str(files.server_key),
                             str(files.ca_cert) if mutual else None)
    async with running_server(tls=server_tls) as running:
        client_tls = tls_client_context(str(files.ca_cert), str(files.client_cert),
                                        str(files.client_key))
        for name in (None, "localhost"):  # the certificate names 127.0.0.1 and localhost
            channel = Channel(running.address, tls=client_tls, server_name=name)
            assert await channel.unary(path("Echo"), b"secret", 5) == b"secret"
            await channel.aclose()
        refusals = [Channel(running.address, tls=client_tls, server_name="other.example"),
                    Channel(running.address)]  # cleartext to a TLS port
        if mutual:  # no client certificate
            refusals.append(Channel(running.address, tls=tls_client_context(str(files.ca_cert))))
        for channel in refusals:
            with pytest.raises(RpcError) as refused:
                await channel.unary(path("Echo"), b"x", 5)
            assert refused.value.code is StatusCode.UNAVAILABLE, refused.value
            await channel.aclose()
        assert running.servicer.seen.requests == [b"secret", b"secret"]


async def test_tls_files_that_cannot_be_used_raise_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        tls_client_context(str(tmp_path / "missing.crt"))
    (tmp_path / "bad.crt").write_text("not a certificate")
    with pytest.raises(ssl.SSLError):
        tls_client_context(str(tmp_path / "bad.crt"))


@pytest.mark.parametrize(("listen", "target"), [
    ("127.0.0.1:{port}", " 127.0.0.1:{port} "),  # routing's address check strips blanks
    ("127.0.0.1:{port}", "localhost:{port}"),
    ("[::1]:{port}", "[::1]:{port}"),
])
async def test_target_forms_services_ratelimit_accepts(listen: str, target: str) -> None:
    port = free_port()
    async with running_server(address=listen.format(port=port)):
        channel = Channel(target.format(port=port))
        assert await channel.unary(path("Echo"), target.encode(), 5) == target.encode()
        await channel.aclose()
    with pytest.raises(ValueError, match="host:port or unix:/path"):
        Channel("no-port")


async def test_unix_socket(tmp_path: Path) -> None:
    target = f"unix:{tmp_path / 'grpc.sock'}"
    async with running_server(address=target):
        channel = Channel(target)
        assert await channel.unary(path("Echo"), b"local", 5) == b"local"
        await channel.aclose()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_a_server_down_fails_unavailable_without_waiting_for_the_deadline() -> None:
    channel = Channel(f"127.0.0.1:{free_port()}")
    for _ in range(3):  # the first attempt, then the pause before the next one
        with pytest.raises(RpcError) as down:
            await channel.unary(path("Echo"), b"x", 60)
        assert down.value.code is StatusCode.UNAVAILABLE
    await channel.aclose()
    with pytest.raises(RpcError) as closed:
        await channel.unary(path("Echo"), b"x", 60)
    assert closed.value.code is StatusCode.UNAVAILABLE


async def test_a_restarted_server_is_reconnected_to() -> None:
    port = free_port()
    channel = Channel(f"127.0.0.1:{port}")
    async with running_server(address=f"127.0.0.1:{port}"):
        assert await channel.unary(path("Echo"), b"one", 5) == b"one"
    with pytest.raises(RpcError) as gone:
        await channel.unary(path("Echo"), b"x", 5)
    assert gone.value.code is StatusCode.UNAVAILABLE
    async with running_server(address=f"127.0.0.1:{port}"):
        async def answered() -> bool:
            try:
                return await channel.unary(path("Echo"), b"two", 5) == b"two"
            except RpcError as exc:
                assert exc.code is StatusCode.UNAVAILABLE
                return False
        await until(answered, timeout_s=10, what="the client to reconnect")
    await channel.aclose()


async def test_calls_in_flight_when_the_connection_is_lost_fail_at_once() -> None:
    async with running_server() as running:
        channel = Channel(running.address)
        calls = [asyncio.ensure_future(channel.unary(path("Hold"), b"x", 60)) for _ in range(5)]
        await until(lambda: running.servicer.seen.in_flight == 5, timeout_s=10,
                    what="five calls in the handler")
        connection = channel._connection
        assert connection is not None and connection.transport is not None
        running.server._connections.copy().pop().transport.abort()  # type: ignore[union-attr]
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, RpcError) and r.code is StatusCode.UNAVAILABLE
                   for r in results), results
        assert await channel.unary(path("Echo"), b"again", 5) == b"again"
        await channel.aclose()


async def test_a_drain_mid_traffic_loses_no_call_silently() -> None:
    """Calls keep coming while the server drains (GOAWAY, calls in flight finish, then it
    closes): every call gets its own answer or an error, none hangs; the calls in flight at
    the GOAWAY are answered."""
    async with running_server() as running:
        channel = Channel(running.address)
        held = [asyncio.ensure_future(channel.unary(path("Hold"), str(i).encode(), 30))
                for i in range(3)]
        await until(lambda: running.servicer.seen.in_flight == 3, timeout_s=10,
                    what="three calls in the handler")
        stopping = asyncio.ensure_future(running.server.stop(10))
        outcomes: list[bytes | RpcError] = []

        async def traffic(i: int) -> None:
            for j in range(20):
                request = f"{i}-{j}".encode()
                try:
                    answer = await channel.unary(path("Echo"), request, 10)
                    assert answer == request
                    outcomes.append(answer)
                except RpcError as exc:
                    assert exc.code is StatusCode.UNAVAILABLE, exc
                    outcomes.append(exc)
                await asyncio.sleep(0)

        load = asyncio.gather(*(traffic(i) for i in range(4)))
        await until(lambda: channel._connection is None or not channel._connection.usable,
                    timeout_s=10, what="the client to see the GOAWAY")
        running.servicer.seen.release.set()
        assert [await call for call in held] == [b"0", b"1", b"2"]
        await load
        await stopping
        assert len(outcomes) == 80
        await channel.aclose()

"""Where the server listens: TLS (ALPN h2), mutual TLS, and a Unix socket."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from sidecar_runtime.h2grpc import tls_context
from tests.harness.tls import TlsFiles, make_tls_files
from tests.sidecar_runtime.h2grpc.servicers import channel, path, running_server, unary


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def _credentials(files: TlsFiles, *, client_cert: bool) -> grpc.ChannelCredentials:
    if not client_cert:
        return grpc.ssl_channel_credentials(root_certificates=files.ca_cert.read_bytes())
    return grpc.ssl_channel_credentials(
        root_certificates=files.ca_cert.read_bytes(),
        private_key=files.client_key.read_bytes(),
        certificate_chain=files.client_cert.read_bytes())


async def test_tls_channel_is_served(tls_files: TlsFiles) -> None:
    context = tls_context(str(tls_files.server_cert), str(tls_files.server_key), None)
    async with running_server(tls=context) as running:
        async with grpc.aio.secure_channel(
                running.address, _credentials(tls_files, client_cert=False)) as ch:
            assert await unary(ch, "Echo", b"over tls") == b"over tls"
        # A cleartext client gets no answer from a TLS port.
        async with channel(running.address) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await unary(plain, "Echo", b"x", timeout=5)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_refuses_a_client_without_a_certificate(tls_files: TlsFiles) -> None:
    context = tls_context(str(tls_files.server_cert), str(tls_files.server_key),
                          str(tls_files.ca_cert))
    async with running_server(tls=context) as running:
        async with grpc.aio.secure_channel(
                running.address, _credentials(tls_files, client_cert=True)) as ch:
            assert await unary(ch, "Echo", b"mutual") == b"mutual"
            assert running.servicer.seen.requests == [b"mutual"]
        async with grpc.aio.secure_channel(
                running.address, _credentials(tls_files, client_cert=False)) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await unary(ch, "Echo", b"anonymous", timeout=5)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert running.servicer.seen.requests == [b"mutual"]


async def test_unix_socket(tmp_path: Path) -> None:
    socket_path = tmp_path / "grpc.sock"
    socket_path.write_text("a stale file from an earlier run")
    async with running_server(address=f"unix:{socket_path}") as running:
        assert running.port == 1
        assert running.server.ports == []
        async with channel(f"unix:{socket_path}") as ch:
            assert await unary(ch, "Echo", b"local") == b"local"
            call = ch.stream_stream(path("Chat"))()
            await call.write(b"peer")
            assert await call.read() == b"PEER"
            await call.done_writing()
            assert await call.code() is grpc.StatusCode.OK

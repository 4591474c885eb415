"""A gRPC port held by a connection, not a listener: the service waits for it instead of
exiting. The defaults 50051 and 50052 lie in Linux's ephemeral range, so after heavy traffic
an outgoing connection (or one in TIME_WAIT) can hold one as its source port; ``llm-sidecar
up`` then failed with "address already in use" for up to a minute (seen after a benchmark)."""

from __future__ import annotations

import asyncio
import errno
import socket
import struct

import pytest
import structlog

from sidecar_runtime.h2grpc import Server
from sidecar_runtime.process.grpc_listen import add_port, listening
from sidecar_runtime.process.settings import Settings
from tests.chaos.support import wait_until


def _held_port() -> tuple[socket.socket, socket.socket, socket.socket, int]:
    """A listener, and a connection to it whose client side is bound to a port of its own:
    that port is then held by a connection no one listens on."""
    target = socket.socket()
    target.bind(("127.0.0.1", 0))
    target.listen()
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))  # no SO_REUSEADDR, as an ordinary client
    holder.connect(target.getsockname())
    accepted, _ = target.accept()
    return target, holder, accepted, holder.getsockname()[1]


def _close_without_time_wait(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
    sock.close()


async def test_a_port_held_by_a_connection_is_waited_for() -> None:
    target, holder, accepted, port = _held_port()
    server = Server()
    try:
        assert not listening("127.0.0.1", port)
        with structlog.testing.capture_logs() as logs:
            binding = asyncio.create_task(add_port(server, "127.0.0.1", port, Settings()))
            await asyncio.to_thread(wait_until, lambda: any(
                entry["event"] == "grpc_port_held" for entry in logs), 10, 0.05)
            assert not binding.done()
            _close_without_time_wait(holder)
            assert await asyncio.wait_for(binding, 10) == port
        await server.start()
        assert listening("127.0.0.1", port)
        held = [entry for entry in logs if entry["event"] == "grpc_port_held"]
        assert len(held) == 1 and held[0]["port"] == port
    finally:
        await server.stop(0)
        for sock in (holder, accepted, target):
            sock.close()


async def test_a_port_someone_listens_on_fails_at_once() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    server = Server()
    try:
        with structlog.testing.capture_logs() as logs, pytest.raises(OSError) as raised:
            await asyncio.wait_for(add_port(server, "127.0.0.1", port, Settings()), 5)
        assert raised.value.errno == errno.EADDRINUSE
        assert not any(entry["event"] == "grpc_port_held" for entry in logs)
    finally:
        await server.stop(0)
        taken.close()

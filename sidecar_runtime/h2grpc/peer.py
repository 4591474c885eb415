"""What both ends of an h2grpc HTTP/2 connection do alike (RFC 9113): :class:`H2Peer`.

The server's :class:`~.connection.Connection` and the client's
:class:`~.client_connection.ClientConnection` are each an :class:`H2Peer`; what a stream is and
what its frames do is theirs, the connection's mechanics are here, written once.
"""

from __future__ import annotations

import asyncio
from typing import Generic, Protocol, TypeVar


class PeerStream(Protocol):
    """What the shared mechanics read and change of a stream."""

    id: int
    send_window: int


S = TypeVar("S", bound=PeerStream)


class H2Peer(asyncio.Protocol, Generic[S]):
    """One end of an HTTP/2 connection; ``S`` is that side's stream."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._out: list[bytes] = []  # frames to send at the end of this loop iteration
        self._reading = False

    # -- writes ----------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        """Queue ``data`` for one write at the end of this loop iteration: what the calls that
        woke in the same iteration send (several streams' messages arrive in one read under
        load; a batcher starts several calls at once) leaves in one ``send`` instead of one
        each, the syscall being a fifth of a message's CPU. Within a read, at the end of the
        read."""
        out = self._out
        out.append(data)
        if len(out) == 1 and not self._reading:
            asyncio.get_running_loop().call_soon(self._uncork)

    def _uncork(self) -> None:
        out = self._out
        if not out:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


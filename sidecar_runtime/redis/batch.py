"""The rate limiter's commands to a standalone Redis: a few persistent pipelined connections of
our own (:mod:`sidecar_runtime.redis.conn`), the commands of one event-loop iteration in one
write, at most :data:`MAX_IN_FLIGHT` commands in flight.

Under load many decisions are in flight at once. redis-py sent each through its pool (one
connection per command, with a pool get and release, a ``getpid`` check and its encoder and
parser layers each time); even pipelined per loop iteration, that machinery was ~100 µs of
ratelimit's CPU per request (docs/decisions/0003-own-redis-connection.md). Here a command is
packed by hiredis's C encoder, appended to the iteration's write, and its reply parsed by
hiredis and handed to the oldest waiting command.

Nothing else changes for a caller: :meth:`CommandBatcher.execute` returns the reply or raises
what redis-py would (a reply error such as ``NoScriptError`` only for its own command; a
``ConnectionError`` for every command in flight on a connection that drops or refuses; a
``TimeoutError`` when Redis stops answering for the socket timeout). After a failure the next
command opens a new connection. A caller that gives up (its deadline cancels it) leaves the
connection in step: its command, if already sent, still runs and its reply is read and dropped.
A burst beyond the bound waits for a slot; it never turns into errors.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from sidecar_runtime.redis.client import MAX_CONNECTIONS
from sidecar_runtime.redis.conn import Endpoint, Phase, RespConnection, pack

MAX_IN_FLIGHT = MAX_CONNECTIONS
"""Commands sent or waiting at once (the bound redis-py's pool size used to set)."""
CONNECTIONS = 2
"""A batch goes on the connection with the fewest commands in flight: a second connection
lets a batch go out while a connection is being reopened, and is opened only under load."""


class CommandBatcher:
    """Sends commands to the standalone Redis of ``client`` (a redis-py client made by
    :func:`~sidecar_runtime.redis.client.make_client`: its URL, credentials and TLS context
    are used, its pool is not)."""

    def __init__(self, client: Redis, connections: int = CONNECTIONS,
                 max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self._endpoint = Endpoint.of(client)
        self._connections: list[RespConnection | None] = [None] * max(1, connections)
        self._max_in_flight = max_in_flight
        self._in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def execute(self, *command: Any, late: Callable[[Any], None] | None = None) -> Any:
        """The reply of ``command``. ``late``: called with the reply if the caller gives up
        (its deadline cancels it) after the command was sent: it still ran in Redis."""
        packed = pack(command)  # an argument of a type redis-py refuses fails before a slot
        if self._in_flight < self._max_in_flight and not self._waiters:
            self._in_flight += 1
        else:
            await self._wait_for_slot()
        if self._closed:
            self._release()
            raise RedisConnectionError("Redis client closed")
        conn = self._connection()
        future = conn.send(packed)
        if late is None:
            return await future
        try:
            return await future
        except asyncio.CancelledError:
            conn.on_late(future, late)
            raise

    def _connection(self) -> RespConnection:
        """The connection this iteration's write is forming on; else an idle one; else a new
        one in a free place (never opened, or failed); else the least loaded."""
        free = -1
        best: RespConnection | None = None
        for n, conn in enumerate(self._connections):
            if conn is None or conn.phase is Phase.CLOSED:
                if free < 0:
                    free = n
            elif conn.batching:
                return conn
            elif best is None or conn.load < best.load:
                best = conn
        if best is not None and (best.load == 0 or free < 0):
            return best
        return self._open(free)

    def _open(self, n: int) -> RespConnection:
        conn = RespConnection(self._endpoint, self._release)
        self._connections[n] = conn
        return conn

    async def _wait_for_slot(self) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # handed a slot just as its caller gave up: pass it on
            else:
                with contextlib.suppress(ValueError):  # _release may have dropped it already
                    self._waiters.remove(waiter)
            raise

    def _release(self) -> None:
        """One command is done with: its slot goes to the first caller still waiting."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; _in_flight stays
                return
        self._in_flight -= 1

    async def aclose(self) -> None:
        """Wait for the replies of the commands in flight (their callers are waiting for
        them), then close the connections."""
        self._closed = True
        live = [conn for conn in self._connections if conn is not None]
        for conn in live:
            await conn.wait_replies()
        for conn in live:
            conn.close()

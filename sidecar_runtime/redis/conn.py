"""One pipelined connection to a standalone Redis: commands written as RESP, replies parsed by
``hiredis`` and matched to their commands first in, first out.

It replaces redis-py's per-command machinery on the rate limiter's hot path (pool get and
release, ``getpid`` checks, the encoder, ``Pipeline.execute``, the re-auth listener: ~15 % of
ratelimit's samples at 600 req/s, docs/decisions/0003-own-redis-connection.md).
What a caller sees stays redis-py's: the
same URL semantics (read from the redis-py client that :func:`~sidecar_runtime.redis.client.
make_client` made, so from redis-py's own ``parse_url``), the same argument encoding, and the
same exceptions (a reply error through redis-py's ``parse_error``: ``NOSCRIPT`` is
``NoScriptError``; a lost connection ``ConnectionError``; a stalled one ``TimeoutError``).

Replies are what RESP carries (``bytes``, ``int``, lists, ``None``, a nested error as an
exception object): redis-py's per-command response callbacks are not applied, and the
connection always speaks RESP2 (a Lua script's replies are the same in both).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, cast

import hiredis
from redis.asyncio import Redis
from redis.asyncio.connection import SSLConnection
from redis.exceptions import AuthenticationWrongNumberOfArgsError, InvalidResponse, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import format_error_message

from sidecar_runtime.compat.redis_internals import BaseParser, Encoder

_ENCODER = Encoder("utf-8", "strict", False)


@dataclass(frozen=True)
class Endpoint:
    """Where and how to connect, as the redis-py client's pool would. The password and the TLS
    context are kept out of ``repr`` (a secret must never reach a log or an error)."""

    host: str
    port: int
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    client_name: str | None = None
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 1.0
    tls: ssl.SSLContext | None = field(default=None, repr=False)
    encoding: str | None = None
    """Set when the URL asked for ``decode_responses``: bulk replies come back as ``str``."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def of(cls, client: Redis) -> Endpoint:
        """The endpoint of ``client``'s pool: its keyword arguments are what redis-py's
        ``parse_url`` read from the URL; a ``rediss://`` pool lends its TLS context (the one
        :mod:`~sidecar_runtime.redis.client` shares, made once at start-up)."""
        pool = client.connection_pool
        kwargs = pool.connection_kwargs
        if "path" in kwargs:
            raise ValueError("a Unix socket Redis is not supported here")
        tls = None
        if issubclass(pool.connection_class, SSLConnection):
            tls = pool.connection_class(**kwargs).ssl_context.get()
        timeout = kwargs.get("socket_timeout") or 1.0
        return cls(
            host=kwargs.get("host", "localhost"), port=int(kwargs.get("port", 6379)),
            db=int(kwargs.get("db") or 0), username=kwargs.get("username"),
            password=kwargs.get("password"), client_name=kwargs.get("client_name"),
            connect_timeout_s=kwargs.get("socket_connect_timeout") or timeout,
            read_timeout_s=timeout, tls=tls,
            encoding=kwargs.get("encoding", "utf-8") if kwargs.get("decode_responses") else None)


def pack(command: tuple[Any, ...]) -> bytes:
    """``command`` as one RESP array, each argument encoded as redis-py encodes it (``str`` as
    UTF-8, ``int`` and ``float`` by ``repr``, ``bytes`` as they are, ``bool`` refused)."""
    try:
        return hiredis.pack_command(command)  # type: ignore[no-any-return]  # the C encoder
    except TypeError:  # bytearray, memoryview, or a type redis-py refuses (raises DataError)
        parts = [_ENCODER.encode(arg) for arg in command]
        return b"".join([b"*%d\r\n" % len(parts),
                         *(b"$%d\r\n%s\r\n" % (len(part), bytes(part)) for part in parts)])


class Phase(Enum):
    CONNECTING = "connecting"  # commands wait in the outbox until AUTH/SELECT are answered
    READY = "ready"
    CLOSED = "closed"  # everything sent or waiting has failed; the owner opens a new one


class RespConnection(asyncio.Protocol):
    """Commands handed to :meth:`send` in one loop iteration leave in one write; each reply
    resolves the oldest command still waiting. A command whose caller gave up stays in that
    queue until its reply is read and dropped, so the others keep their own replies.

    ``release()`` is called once per command when it is done with (replied, failed, or dropped
    unsent): the owner's bound on commands in flight.
    """

    def __init__(self, endpoint: Endpoint, release: Callable[[], None]) -> None:
        self._endpoint = endpoint
        self._release = release
        self._loop = asyncio.get_running_loop()
        kwargs: dict[str, Any] = {"protocolError": InvalidResponse,
                                  "replyError": BaseParser.parse_error}
        if endpoint.encoding is not None:
            kwargs["encoding"] = endpoint.encoding
        self._reader = hiredis.Reader(**kwargs)
        self.phase = Phase.CONNECTING
        self._transport: asyncio.Transport | None = None
        self._outbox: list[tuple[bytes, asyncio.Future[Any]]] = []
        self._sent: deque[asyncio.Future[Any]] = deque()  # written, reply not read yet
        self._late: dict[asyncio.Future[Any], Callable[[Any], None]] = {}
        """Callers that gave up on a command but want its reply (see :meth:`on_late`)."""
        self._internal = 0  # the first entries of _sent are the handshake's, not the owner's
        self._flush_due = False
        self._progress = 0.0  # when a reply last arrived (or the queue last started)
        self._stall: asyncio.TimerHandle | None = None
        self._opening = self._loop.create_task(self._open())

    def on_late(self, future: asyncio.Future[Any], late: Callable[[Any], None]) -> None:
        """``late(reply)`` when the reply of ``future``'s command (which its caller gave up on)
        arrives: the command still ran in Redis, and its caller may have to undo it. Never
        called for a command dropped unsent, or lost with its connection (its fate unknown)."""
        if future in self._sent or any(f is future for _, f in self._outbox):
            self._late[future] = late

    @property
    def load(self) -> int:
        """Commands waiting in the outbox or for their reply."""
        return len(self._outbox) + len(self._sent) - self._internal

    @property
    def batching(self) -> bool:
        """True while a write is due this iteration: a command sent now joins it."""
        return bool(self._outbox)

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        """Queue ``packed`` for this iteration's write; the future gets its reply."""
        future: asyncio.Future[Any] = self._loop.create_future()
        self._outbox.append((packed, future))
        if self.phase is Phase.READY and not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        self._flush_due = False
        if self.phase is not Phase.READY or not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        idle = not self._sent
        chunks = []
        for packed, future in outbox:
            if future.done():  # its caller gave up before it was sent: never sent
                self._release()
                self._late.pop(future, None)
                continue
            chunks.append(packed)
            self._sent.append(future)
        if chunks:
            self._write(b"".join(chunks), idle)

    def _write(self, data: bytes, idle: bool) -> None:
        """``idle``: nothing was waiting for a reply, so the read timeout starts now."""
        assert self._transport is not None
        if idle:
            self._progress = self._loop.time()
        if self._stall is None:
            self._stall = self._loop.call_later(self._endpoint.read_timeout_s, self._check_stall)
        self._transport.write(data)

    async def _open(self) -> None:
        """Connect and hand-shake; then the commands that waited go in one write. Whatever
        goes wrong fails them all at once: a connection never stays half-open."""
        try:
            await self._connect()
            await self._handshake()  # an AUTH or SELECT refused raises what redis-py raises
            if self.phase is Phase.CLOSED:  # Redis hung up right after the handshake
                return
            self.phase = Phase.READY
            self._flush()
        except RedisError as exc:
            self._close(exc)
        except Exception as exc:  # not Redis's answer: say what, never the command's text
            self._close(RedisConnectionError(f"Redis connection failed: {type(exc).__name__}"))
            raise
        except BaseException:
            self._close(RedisConnectionError("Redis connection closed"))
            raise

    async def _connect(self) -> None:
        endpoint = self._endpoint
        try:
            async with asyncio.timeout(endpoint.connect_timeout_s):
                await self._loop.create_connection(lambda: self, endpoint.host, endpoint.port,
                                                   ssl=endpoint.tls)
        except TimeoutError:  # the builtin (asyncio.timeout's), an OSError: checked first
            raise RedisTimeoutError("Timeout connecting to server") from None
        except OSError as exc:
            raise RedisConnectionError(format_error_message(endpoint.address, exc)) from None

    async def _handshake(self) -> None:
        """AUTH, SELECT and CLIENT SETNAME as redis-py's ``on_connect`` sends them (RESP2).
        A refusal raises what redis-py raises; its text never holds the password."""
        endpoint = self._endpoint
        if endpoint.username or endpoint.password:
            auth = (endpoint.username, endpoint.password or "") if endpoint.username else \
                (endpoint.password,)
            try:
                await self._ask(("AUTH", *auth))
            except AuthenticationWrongNumberOfArgsError:  # a Redis before 6: no ACL users
                await self._ask(("AUTH", endpoint.password or ""))
        if endpoint.client_name:
            await self._ask(("CLIENT", "SETNAME", endpoint.client_name))
        if endpoint.db:
            await self._ask(("SELECT", endpoint.db))

    async def _ask(self, command: tuple[Any, ...]) -> Any:
        if self.phase is Phase.CLOSED:
            raise RedisConnectionError("Connection closed by server.")
        future: asyncio.Future[Any] = self._loop.create_future()
        idle = not self._sent
        self._sent.append(future)
        self._internal += 1
        self._write(pack(command), idle)
        return await future

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        self._progress = self._loop.time()
        sent = self._sent
        while True:
            try:
                reply = self._reader.gets()
            except InvalidResponse as exc:  # the stream can no longer be trusted
                self._close(exc)
                return
            if reply is False:
                return
            if not sent:
                self._close(InvalidResponse("Redis sent a reply to no command"))
                return
            future = sent.popleft()
            if self._internal:
                self._internal -= 1
            else:
                self._release()
            if future.done():  # its caller gave up: the reply is read and dropped
                late = self._late.pop(future, None) if self._late else None
                if late is not None:
                    late(reply)
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        detail = f"Error while reading from {self._endpoint.address} : {exc}" if exc else \
            "Connection closed by server."
        self._close(RedisConnectionError(detail))

    def _check_stall(self) -> None:
        self._stall = None
        if not self._sent or self.phase is Phase.CLOSED:
            return
        waited = self._loop.time() - self._progress
        if waited >= self._endpoint.read_timeout_s:
            self._close(RedisTimeoutError(f"Timeout reading from {self._endpoint.address}"))
        else:
            self._stall = self._loop.call_later(self._endpoint.read_timeout_s - waited,
                                                self._check_stall)

    def _close(self, exc: Exception) -> None:
        """Fail every command sent or waiting with ``exc`` at once, and drop the socket."""
        if self.phase is Phase.CLOSED:
            return
        self.phase = Phase.CLOSED
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if self._transport is not None:
            self._transport.abort()
        waiting = [*self._sent, *(future for _, future in self._outbox)]
        owned = len(waiting) - self._internal
        self._sent.clear()
        self._outbox.clear()
        self._late.clear()
        self._internal = 0
        for _ in range(owned):
            self._release()
        for future in waiting:
            if not future.done():
                future.set_exception(exc)

    def close(self) -> None:
        """Fail what is still waiting and drop the socket (and a connect under way)."""
        if not self._opening.done():
            self._opening.cancel()
        self._close(RedisConnectionError("Redis connection closed"))

    async def wait_replies(self) -> None:
        """Until every command sent or waiting has its reply (or the connection failed)."""
        pending = [f for f in (*self._sent, *(f for _, f in self._outbox)) if not f.done()]
        if pending:
            await asyncio.wait(pending)

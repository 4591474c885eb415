"""Issue 33's probes, each through a real socket against the server in a process of its own
(``attack_server``): what one hostile connection can make the server hold or do.

Each attack must leave the server's RSS less than 64 MB above where it started, a health check
on a second connection answered within 1 s throughout (checked every 50 ms by a grpcio client on
its own thread), and end as the limits say (:mod:`sidecar_runtime.h2grpc.limits`): a flood with
GOAWAY ``ENHANCE_YOUR_CALM``, data past a window with FLOW_CONTROL_ERROR, a slow or idle peer
closed. The attacker writes frames from the test's thread with a blocking socket, and a thread
of its own reads what the server sends (so the server never stops reading it for want of a
reader).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
import hpack
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
)

from sidecar_runtime.h2grpc import frames as f
from sidecar_runtime.h2grpc.call import Call
from sidecar_runtime.h2grpc.limits import MIB, Limits
from tests.harness.waits import until, wait_for
from tests.sidecar_runtime.h2grpc.clients import PREFACE, H2Client, grpc_headers, message
from tests.sidecar_runtime.h2grpc.servicers import path, running_server

RSS_BOUND = 64 * 1024 * 1024
HEALTH_BOUND_S = 2.5
"""The issue's figure is 1 s (met on an idle machine, each test alone: the closing note of
issue 33 has them); asserted with a margin, as these share two cores with the rest of the
suite. The health check's first call (its connection set up) is not counted."""
WAIT_S = 20.0
"""How long a test waits for the server to react: a bound for a broken server only."""
RATELIMIT_MAX_RECEIVE = 4 * MIB
ROOT = Path(__file__).resolve().parents[3]


@dataclass
class Target:
    process: subprocess.Popen[str]
    port: int

    def rss(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


@contextlib.contextmanager
def attack_server(max_receive: int = RATELIMIT_MAX_RECEIVE, **limits: Any) -> Iterator[Target]:
    """The server in a process of its own, with ``limits`` (a rate as ``[burst, per_s]``)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.sidecar_runtime.h2grpc.attack_server", str(max_receive),
         json.dumps(limits)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("port "), line
        yield Target(process, int(line.split()[1]))
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Health:
    """A grpcio health check on a connection of its own, every 50 ms, on a thread."""

    port: int
    slowest_s: float = 0.0
    checks: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _run(self) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=5.0)
                except grpc.RpcError as exc:
                    self.failures.append(str(exc.code()))
                if self.checks:
                    self.slowest_s = max(self.slowest_s, time.monotonic() - started)
                self.checks += 1
                self._stop.wait(0.05)

    @contextlib.contextmanager
    def watching(self) -> Iterator[Health]:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        wait_for(lambda: self.checks > 0, timeout=WAIT_S, what="a first health check")
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()
        assert self.failures == [], self.failures
        print(f"slowest health check: {self.slowest_s * 1000:.0f} ms of {self.checks}")
        assert self.slowest_s < HEALTH_BOUND_S, f"a health check took {self.slowest_s:.2f} s"


@contextlib.contextmanager
def bounded(target: Target) -> Iterator[None]:
    """The attack inside leaves RSS < 64 MB above where it started and health answered."""
    before = target.rss()
    with Health(target.port).watching():
        yield
        grown = target.rss() - before
    print(f"RSS grew {grown / MIB:.1f} MiB")
    assert grown < RSS_BOUND, f"RSS grew {grown / MIB:.0f} MiB"


class Attacker:
    """A raw HTTP/2 connection: frames out from the test's thread, frames in on a thread."""

    def __init__(self, port: int, *, preface: bytes = PREFACE + SettingsFrame(0).serialize(),
                 ) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.received: list[Frame] = []
        self.closed = threading.Event()
        self.encoder = hpack.Encoder()
        self.encoder.header_table_size = 0  # as the server's SETTINGS asks
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if preface:
            self.send(preface)

    def _read(self) -> None:
        buffer = b""
        try:
            while chunk := self.sock.recv(1 << 20):
                buffer += chunk
                while len(buffer) >= 9:
                    frame, length = Frame.parse_frame_header(memoryview(buffer[:9]))
                    if len(buffer) < 9 + length:
                        break
                    frame.parse_body(memoryview(buffer[9:9 + length]))
                    buffer = buffer[9 + length:]
                    self.received.append(frame)
        except OSError:
            pass
        finally:
            self.closed.set()

    def send(self, *frames: Frame | bytes) -> bool:
        """False once the server closed the connection."""
        try:
            self.sock.sendall(b"".join(x if isinstance(x, bytes) else x.serialize()
                                       for x in frames))
            return True
        except OSError:
            return False

    def block(self, headers: list[tuple[str, str]]) -> bytes:
        return self.encoder.encode(headers)

    def goaway(self) -> GoAwayFrame:
        """The GOAWAY the server ended the connection with (it must then close it)."""
        assert self.closed.wait(WAIT_S), "the server kept the connection open"
        found = [frame for frame in self.received if isinstance(frame, GoAwayFrame)]
        assert found, f"closed without GOAWAY after {self.received[-5:]}"
        return found[-1]

    def resets(self) -> dict[int, int]:
        return {frame.stream_id: frame.error_code for frame in self.received
                if isinstance(frame, RstStreamFrame)}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._reader.join()


@contextlib.contextmanager
def attacker(port: int, **options: Any) -> Iterator[Attacker]:
    opened = Attacker(port, **options)
    try:
        yield opened
    finally:
        opened.close()


def flood(send: Callable[[], bool], until_closed: threading.Event, seconds: float) -> int:
    """Call ``send`` until the server closed the connection (or ``seconds`` passed)."""
    sent = 0
    deadline = time.monotonic() + seconds
    while not until_closed.is_set() and time.monotonic() < deadline and send():
        sent += 1
    return sent


def headers(a: Attacker, stream: int, method: str, *, end_stream: bool = False,
            extra: list[tuple[str, str]] | None = None) -> HeadersFrame:
    frame = HeadersFrame(stream, a.block(grpc_headers(path(method)) + (extra or [])))
    frame.flags.add("END_HEADERS")
    if end_stream:
        frame.flags.add("END_STREAM")
    return frame


# -- flow control on receive ---------------------------------------------------------------------


def test_data_past_a_streams_window_resets_it_and_holds_nothing() -> None:
    """200 MiB on a stream with 4 MiB of window (its handler reads nothing): the stream is reset
    FLOW_CONTROL_ERROR once its window is spent, what follows is dropped, the connection lives."""
    chunk = DataFrame(1, b"\0" * 16_384).serialize()
    with attack_server() as target, bounded(target), attacker(target.port) as a:
        a.send(headers(a, 1, "Stall"))
        for _ in range(200 * 64):
            if not a.send(chunk):
                break
        wait_for(lambda: 1 in a.resets(), timeout=WAIT_S, what="the stream's reset")
        assert a.resets()[1] == f.FLOW_CONTROL_ERROR
        assert not a.closed.is_set()


def test_data_past_the_connection_window_ends_the_connection() -> None:
    """Five streams whose handlers read nothing, each sent its whole 4 MiB window: 20 MiB, past
    the connection's 16 MiB, which is never given back while the calls hold it."""
    with attack_server() as target, bounded(target), attacker(target.port) as a:
        chunk = b"\0" * 16_384
        for stream in range(1, 11, 2):
            a.send(headers(a, stream, "Stall"))
            for _ in range(256):
                if not a.send(DataFrame(stream, chunk)):
                    break
        assert a.goaway().error_code == f.FLOW_CONTROL_ERROR


async def test_partial_messages_that_fill_the_connection_buffer_fail_the_largest_call() -> None:
    """Three calls each send 900 KB of a 1 MB message, within every window the server granted:
    2.7 MB of partial messages against a 2 MiB buffer, none of which a handler can take. The
    call holding the most fails RESOURCE_EXHAUSTED; the others then finish."""
    limits = Limits(connection_buffer=MIB)  # one 1 MB message + 1 MiB: 2 MiB
    async with running_server(max_receive=1_000_000, limits=limits) as running:
        assert running.server.connection_buffer == 1_000_000 + 5 + MIB
        client = await H2Client.open(running.port)
        whole = message(b"m" * (1_000_000 - 5))
        streams = [client.request(path("Echo"), whole[:900_000], end=False) for _ in range(3)]
        await client.until(lambda: any(client.answers[s].done for s in streams))
        failed = [s for s in streams if client.answers[s].done]
        assert len(failed) == 1
        assert client.answers[failed[0]].grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        for stream in streams:
            if stream not in failed:
                client.send(stream, whole[900_000:], end=True)
        await client.until(lambda: all(client.answers[s].done for s in streams))
        for stream in streams:
            if stream not in failed:
                assert client.answers[stream].grpc_status == 0
                assert len(client.answers[stream].body) == len(whole)
        await client.close()


# -- header memory ---------------------------------------------------------------------------------


def _references(count: int) -> bytes:
    """``count`` one-byte references to the static table's ``content-length: ""`` (index 28)."""
    return b"\x9c" * count


def test_a_header_block_of_one_byte_references_past_the_list_limit_ends_the_connection() -> None:
    """Issue 33's block: 1.9 KB of 1,866 one-byte references, ~85 KB as RFC 9113 counts it,
    on 200 connections one after another: each ends COMPRESSION_ERROR, nothing is kept."""
    with attack_server() as target, bounded(target):
        for _ in range(200):
            with attacker(target.port) as a:
                block = a.block(grpc_headers(path("Echo"))) + _references(1_866)
                a.send(HeadersFrame(1, block, flags=["END_HEADERS", "END_STREAM"]))
                assert a.goaway().error_code == f.COMPRESSION_ERROR


def test_header_blocks_within_the_list_limit_but_of_too_many_fields_are_refused() -> None:
    """1,024 blocks of 300 references (13.8 KB of list, 306 fields) on one connection: each call
    answered RESOURCE_EXHAUSTED, none decoded into the process-wide cache."""
    with attack_server() as target, bounded(target), attacker(target.port) as a:
        for n in range(1_024):
            stream = 2 * n + 1
            block = a.block(grpc_headers(path("Echo"))) + _references(300)
            a.send(HeadersFrame(stream, block, flags=["END_HEADERS", "END_STREAM"]))
        wait_for(lambda: sum(isinstance(x, HeadersFrame) for x in a.received) >= 1_024,
                 timeout=WAIT_S, what="1,024 answers")
        statuses = [dict(cast(list[tuple[str, str]], hpack.Decoder().decode(x.data)))
                    for x in a.received if isinstance(x, HeadersFrame)]
        assert all(fields.get("grpc-status") == "8" for fields in statuses)


def test_streams_held_open_with_large_heads_are_bounded_per_connection() -> None:
    """15 connections x 100 streams, each head 94 fields of metadata, none ever sends its
    message: past 1 MiB of heads a connection refuses new streams (REFUSED_STREAM)."""
    with attack_server() as target, bounded(target):
        attackers = [Attacker(target.port) for _ in range(15)]
        try:
            for a in attackers:
                for n in range(100):
                    block = a.block(grpc_headers(path("Hold"))) + _references(94)
                    a.send(HeadersFrame(2 * n + 1, block, flags=["END_HEADERS"]))
            for a in attackers:
                wait_for(lambda a=a: f.REFUSED_STREAM in a.resets().values(),  # type: ignore[misc]
                         timeout=WAIT_S, what="a refused stream")
                assert not a.closed.is_set()
        finally:
            for a in attackers:
                a.close()


# -- floods --------------------------------------------------------------------------------------


def test_a_continuation_flood_ends_with_enhance_your_calm() -> None:
    """Empty CONTINUATION frames after a HEADERS, for up to 10 s: the ninth ends it."""
    with attack_server() as target, bounded(target), attacker(target.port) as a:
        a.send(HeadersFrame(1, a.block(grpc_headers(path("Echo")))))
        empty = ContinuationFrame(1).serialize() * 1_000
        sent = flood(lambda: a.send(empty), a.closed, 10.0)
        assert a.goaway().error_code == f.ENHANCE_YOUR_CALM
        assert sent < 1_000, "the flood was read for long"


def test_rapid_reset_ends_with_enhance_your_calm() -> None:
    """20,000 HEADERS + RST_STREAM pairs (CVE-2023-44487): GOAWAY after the budget (1,000)."""
    with attack_server() as target, bounded(target), attacker(target.port) as a:
        pairs = b"".join(headers(a, 2 * n + 1, "Hold", end_stream=True).serialize()
                         + RstStreamFrame(2 * n + 1, error_code=f.CANCEL).serialize()
                         for n in range(20_000))
        a.send(pairs)
        assert a.goaway().error_code == f.ENHANCE_YOUR_CALM


def test_settings_and_ping_floods_end_with_enhance_your_calm() -> None:
    with attack_server() as target, bounded(target):
        with attacker(target.port) as a:  # 2,730 entries in one SETTINGS
            entries = b"".join(struct.pack(">HI", f.SETTINGS_INITIAL_WINDOW_SIZE, 65_535 + i)
                               for i in range(2_730))
            a.send(f.frame(f.SETTINGS, 0, 0, entries))
            assert a.goaway().error_code == f.ENHANCE_YOUR_CALM
        with attacker(target.port) as a:  # 100,000 PINGs
            a.send(PingFrame(0, opaque_data=b"12345678").serialize() * 100_000)
            assert a.goaway().error_code == f.ENHANCE_YOUR_CALM
            answered = sum(isinstance(x, PingFrame) for x in a.received)
            assert answered <= Limits().pings.burst + 10
        with attacker(target.port) as a:  # 1,000 SETTINGS frames
            a.send(SettingsFrame(0, settings={f.SETTINGS_MAX_FRAME_SIZE: 16_384}).serialize()
                   * 1_000)
            assert a.goaway().error_code == f.ENHANCE_YOUR_CALM


def test_frames_that_do_nothing_end_with_enhance_your_calm() -> None:
    """Empty DATA (no END_STREAM), PRIORITY and unknown frame types, 5,000 of each."""
    unknown = f.frame(0x42, 0, 1, b"x")
    with attack_server() as target, bounded(target):
        for frame in (DataFrame(1).serialize(), PriorityFrame(1).serialize(), unknown):
            with attacker(target.port) as a:
                a.send(headers(a, 1, "Stall"), frame * 5_000)
                assert a.goaway().error_code == f.ENHANCE_YOUR_CALM


# -- slow and idle peers, connection count -------------------------------------------------------


FAST_TIMEOUTS: dict[str, Any] = {"handshake_timeout_s": 1.0, "incomplete_timeout_s": 1.0,
                                 "idle_timeout_s": 2.0, "sweep_s": 0.1}


def test_slow_and_idle_peers_are_closed_but_a_connection_with_a_call_is_kept() -> None:
    with attack_server(**FAST_TIMEOUTS) as target:
        tcp_only = Attacker(target.port, preface=b"")
        preface_only = Attacker(target.port, preface=PREFACE)
        half_block = Attacker(target.port)
        half_block.send(HeadersFrame(1, half_block.block(grpc_headers(path("Echo")))))
        half_frame = Attacker(target.port)
        half_frame.send(f.frame(f.DATA, 0, 1, b"x" * 100)[:50])
        idle = Attacker(target.port)
        busy = Attacker(target.port)
        busy.send(headers(busy, 1, "Echo"))  # its message comes late: the call stays open
        try:
            for a in (tcp_only, preface_only, half_block, half_frame, idle):
                assert a.closed.wait(WAIT_S), "a slow or idle peer was kept"
            assert idle.goaway().error_code == f.NO_ERROR
            assert not busy.closed.is_set()
            busy.send(DataFrame(1, message(b"still here"), flags=["END_STREAM"]))
            wait_for(lambda: any(isinstance(x, DataFrame) and x.data for x in busy.received),
                     timeout=WAIT_S, what="the kept call's answer")
        finally:
            for a in (tcp_only, preface_only, half_block, half_frame, idle, busy):
                a.close()


def test_connections_past_the_cap_are_refused() -> None:
    with attack_server(max_connections=4) as target:
        kept = [Attacker(target.port) for _ in range(3)]  # + the health check's: 4
        try:
            with Health(target.port).watching():
                wait_for(lambda: all(any(isinstance(x, SettingsFrame) for x in a.received)
                                     for a in kept), timeout=WAIT_S, what="three connections")
                with attacker(target.port) as extra:
                    assert extra.goaway().error_code == f.ENHANCE_YOUR_CALM
                kept.pop().close()
                again = Attacker(target.port)
                kept.append(again)
                again.send(headers(again, 1, "Echo"),
                           DataFrame(1, message(b"in"), flags=["END_STREAM"]))
                wait_for(lambda: any(isinstance(x, DataFrame) for x in again.received),
                         timeout=WAIT_S, what="an answer once a connection closed")
        finally:
            for a in kept:
                a.close()


# -- no cycles for the garbage collector ------------------------------------------------------------


async def test_a_stream_reset_before_or_while_its_handler_runs_leaves_no_cycle() -> None:
    """Issue 33 saw Rapid Reset leave Call/Task cycles that only a full collection freed (tens
    of MB per 20,000 with the GC threshold raised). Each call, reset before its handler started
    or while it ran, must be freed by reference counts alone: none is left for the collector.
    (A call also lets go of its task once it is done, which breaks that cycle wherever a
    cancelled task's traceback would hold the call.)"""
    async with running_server() as running:
        client = await H2Client.open(running.port)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(100):  # reset before its message: no handler yet
                stream = client.request(path("Hold"), None, end=False)
                client.conn.reset_stream(stream, f.CANCEL)
            client.flush()
            running_calls = [client.request(path("Hold"), message(b"x")) for _ in range(100)]
            await until(lambda: running.servicer.seen.in_flight == 100, timeout_s=WAIT_S,
                        what="100 handlers running")
            for stream in running_calls:  # reset while its handler waits
                client.conn.reset_stream(stream, f.CANCEL)
            client.flush()
            await until(lambda: running.server._active == 0 and not any(
                c._streams for c in running.server._connections), timeout_s=WAIT_S,
                what="every call over")
            gc.collect()
            cycles = [o for o in gc.garbage if isinstance(o, Call)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert cycles == []
        await client.close()


def test_resets_of_a_connection_that_mostly_served_calls_are_not_an_attack() -> None:
    """Envoy resets an ext_proc stream when its client goes away: 1,500 such resets (past the
    budget) after 3,000 answered calls keep the connection, as they are not half its calls."""
    with attack_server() as target, attacker(target.port) as a:
        def answered() -> int:
            return sum(isinstance(x, DataFrame) and bool(x.data) for x in a.received)

        for batch in range(60):  # 50 at a time: within the 100 streams a connection may open
            a.send(b"".join(headers(a, 2 * n + 1, "Echo").serialize()
                            + DataFrame(2 * n + 1, message(b"x"), flags=["END_STREAM"]).serialize()
                            for n in range(50 * batch, 50 * batch + 50)))
            wait_for(lambda batch=batch: answered() >= 50 * batch + 50,  # type: ignore[misc]
                     timeout=WAIT_S, what="a batch's answers")
        first = 6_001
        aborts = b"".join(headers(a, first + 2 * n, "Hold", end_stream=True).serialize()
                          + RstStreamFrame(first + 2 * n, error_code=f.CANCEL).serialize()
                          for n in range(1_500))
        a.send(aborts, headers(a, first + 3_000, "Echo"),
               DataFrame(first + 3_000, message(b"after"), flags=["END_STREAM"]))
        wait_for(lambda: any(isinstance(x, DataFrame) and x.stream_id == first + 3_000
                             for x in a.received), timeout=WAIT_S, what="the call after them")
        assert not any(isinstance(x, GoAwayFrame) for x in a.received)

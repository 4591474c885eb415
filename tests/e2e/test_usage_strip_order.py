"""The Lua filter that strips an injected usage chunk must not run while ext_proc holds the
response headers (issue 16): its ``setBytes`` also sets the response's ``content-length`` to the
chunk's length, and headers sent after that carry it instead of chunked framing.

Real Envoy with the filters ``render`` writes, in its order, with ext_proc's place taken by a
Lua filter that holds the response headers 400 ms (an ``httpCall``), as ext_proc does until
extproc answers; the pool (``bench.lua_strip_repro``) sends a 3-token stream, an event every 20 ms, so every
chunk reaches the filters before the headers leave.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from bench.lua_strip_repro import Upstream, repro_envoy
from tests.harness.h2c import h2_request

pytestmark = pytest.mark.e2e

BODY = json.dumps({"model": "m", "stream": True, "messages": []}).encode()
STREAM_END = b"data: [DONE]\n\n"


def _holding(order: str, lua: str = "rendered") -> Iterator[int]:
    upstream = Upstream(tokens=3, pace_ms=20, pattern="event", hold_ms=0, hold_from_ms=400)
    with repro_envoy(order, lua, upstream) as (listen, _admin, _log):
        yield listen


@pytest.fixture(scope="module")
def rendered() -> Iterator[int]:
    yield from _holding("rendered")


@pytest.fixture(scope="module")
def before_fix() -> Iterator[int]:
    yield from _holding("before-fix")


class Conn:
    """One HTTP/1.1 keep-alive connection, responses read by their own framing."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""

    def _need(self, n: int) -> None:
        while len(self.buf) < n:
            got = self.sock.recv(65536)
            assert got, "connection closed"
            self.buf += got

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._need(len(self.buf) + 1)
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _take(self, n: int) -> bytes:
        self._need(n)
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def stream(self) -> tuple[bytes, dict[str, str], bytes]:
        """POST one streamed request: (status line, headers, body as framed)."""
        self.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                          b"content-type: application/json\r\nx-strip-usage: 1\r\n"
                          b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY))
        status = self._line()
        headers = {}
        while line := self._line():
            name, _, value = line.decode().partition(":")
            headers[name.lower()] = value.strip()
        if "content-length" in headers:
            return status, headers, self._take(int(headers["content-length"]))
        body = b""
        while size := int(self._line(), 16):
            body += self._take(size)
            assert self._line() == b""
        assert self._line() == b""
        return status, headers, body

    def following(self, n: int) -> bytes:
        """The next ``n`` bytes on the connection after the last response."""
        return self._take(n)

    def close(self) -> None:
        self.sock.close()


def test_streams_stay_chunked_and_whole_on_one_keep_alive_connection(rendered: int) -> None:
    conn = Conn(rendered)
    try:
        for _ in range(3):
            status, headers, body = conn.stream()
            assert status == b"HTTP/1.1 200 OK"
            assert headers.get("transfer-encoding") == "chunked", headers
            assert "content-length" not in headers
            assert body.endswith(STREAM_END) and body.count(b"data: ") == 4, body
            assert b'"usage"' not in body
    finally:
        conn.close()


def test_h2_streams_carry_no_content_length(rendered: int) -> None:
    for _ in range(2):
        resp = h2_request(f"127.0.0.1:{rendered}", [
            (":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
            (":authority", "x"), ("x-strip-usage", "1"), ("content-length", str(len(BODY)))],
            body=BODY)
        assert resp.status == 200 and "content-length" not in resp.headers, resp.headers
        assert resp.body.endswith(STREAM_END) and b'"usage"' not in resp.body


def test_the_lua_filter_after_ext_proc_gave_the_stream_a_wrong_length(before_fix: int) -> None:
    """The order before the fix, with the Lua filter as it is now: the headers leave with the
    length of the rewritten last chunk, and the rest of the stream is read as the next response
    (what aiohttp reported as ClientResponseError in the soak)."""
    conn = Conn(before_fix)
    try:
        status, headers, body = conn.stream()
        assert status == b"HTTP/1.1 200 OK"
        # The length of the last chunk the filter rewrote (0: the emptied usage chunk).
        assert "transfer-encoding" not in headers and "content-length" in headers
        assert not body.endswith(STREAM_END), body
        assert conn.following(6) == b"data: ", "the rest of the stream follows unframed"
    finally:
        conn.close()

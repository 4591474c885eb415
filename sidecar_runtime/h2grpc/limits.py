"""What one peer may make the gRPC server hold or do: the limits a trusted HTTP/2 server keeps
(nghttp2's and Envoy's, RFC 9113 §10.5), each with its default, and the token bucket the frame
budgets are kept in.

Every limit is per connection unless it says otherwise. Past a flood budget the connection ends
with GOAWAY ``ENHANCE_YOUR_CALM``; past a memory bound the stream is refused or the sender is
held back by flow control; a timeout ends the connection with GOAWAY ``NO_ERROR``. The docs'
security page and docs/security/threat-model.md list them; ``tests/sidecar_runtime/h2grpc/
test_attacks.py`` tries to get around each one through a real socket.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

MIB = 1024 * 1024
MAX_CONTINUATIONS = 8
"""CONTINUATION frames after one HEADERS (nghttp2's default), for the server and the client."""
MESSAGE_OVERHEAD = 64
"""What each message waiting for its handler costs beyond its bytes (a Python ``bytes`` and its
slot in the queue), counted against the connection's buffer: 16 MiB of empty messages is not
3 million objects."""


@dataclass(frozen=True, slots=True)
class Rate:
    """A token bucket's shape: ``burst`` frames (or other units) at once, ``per_s`` more each
    second."""

    burst: float
    per_s: float


@dataclass(frozen=True, slots=True)
class Limits:
    """The server's limits. The defaults fit Envoy as the peer (its ext_proc streams, health
    checks and rate-limit calls) with a wide margin; tests shrink them."""

    max_connections: int = 1024
    """Open connections per process; one more is answered GOAWAY ``ENHANCE_YOUR_CALM`` and
    closed. Envoy opens a few per worker per service."""
    stream_window: int = 4 * MIB
    """Each stream's receive window (SETTINGS_INITIAL_WINDOW_SIZE), given back only as the
    handler takes messages; DATA past it resets the stream (FLOW_CONTROL_ERROR)."""
    connection_buffer: int = 16 * MIB
    """Bytes of request data one connection may hold unread by handlers (its receive window is
    given back only as they are released); raised to one whole message plus 1 MiB where the
    service's message limit is larger. DATA past the connection window is a connection error
    (FLOW_CONTROL_ERROR)."""
    max_header_list: int = 16 * 1024
    """A request's header list as RFC 9113 counts it (SETTINGS_MAX_HEADER_LIST_SIZE, names +
    values + 32 per field) and the largest header block read; gRPC's own hard limit."""
    max_header_fields: int = 100
    """Fields in one request's header block (Envoy's ``max_headers_count``); more: the call is
    answered RESOURCE_EXHAUSTED."""
    header_bytes: int = 1 * MIB
    """Request headers the open streams of a connection may hold, as Python holds them
    (:data:`.head.FIELD_OVERHEAD` per field, not RFC 7541's 32); a stream past it is refused."""
    heads_cache_bytes: int = 2 * MIB
    """The process-wide cache of decoded request heads (Envoy sends the same few blocks on
    every call), in the same bytes; a head above :data:`.head.HEAD_CACHED_MAX_HELD` is not
    cached at all."""
    max_continuations: int = MAX_CONTINUATIONS
    """CONTINUATION frames after one HEADERS; more is a flood."""
    max_settings_entries: int = 32
    """Entries in one SETTINGS frame (nghttp2's ``max_settings``)."""
    pings: Rate = Rate(100, 10.0)
    """PINGs answered; Envoy's keepalive sends one every interval (seconds at least)."""
    settings: Rate = Rate(100, 10.0)
    """SETTINGS frames (each may touch every open stream's window)."""
    premature_resets: Rate = Rate(1000, 33.0)
    """Streams the peer reset before the server answered their headers (Rapid Reset,
    CVE-2023-44487; nghttp2's stream reset rate limit, 1,000 then 33 a second), counted while
    they are at least half of the connection's calls (Envoy's premature reset rule): Envoy
    resets an ext_proc stream when its client goes away, mostly after extproc's first answer,
    and a burst of such aborts on a connection of many calls is no attack."""
    glitches: Rate = Rate(1000, 33.0)
    """Frames that do nothing (empty DATA and CONTINUATION that end nothing, PRIORITY, unknown
    types, unsolicited PING acks): the shape of nghttp2's glitch rate limit as first shipped
    (1.61; later releases allow 10,000 then 330 a second)."""
    handshake_timeout_s: float = 10.0
    """From the TCP (or TLS) connection to the peer's preface and first SETTINGS."""
    incomplete_timeout_s: float = 10.0
    """A frame or header block begun and not finished (half a HEADERS, no END_HEADERS)."""
    idle_timeout_s: float = 600.0
    """No open stream and no frame at all for this long: GOAWAY and close. Envoy's own upstream
    idle timeout for the services' clusters is rendered at half of it (Envoy closes first,
    cleanly), and its keepalive PINGs count as frames."""
    sweep_s: float = 1.0
    """How often the timeouts are checked."""

    def buffer_for(self, max_message: int) -> int:
        """The connection buffer for a service whose messages go up to ``max_message``."""
        return max(self.connection_buffer, max_message + 5 + MIB)


class Budget:
    """A token bucket (nghttp2's rate limits): :meth:`spend` is False once it is empty."""

    __slots__ = ("_at", "_burst", "_per_s", "_tokens")

    def __init__(self, rate: Rate) -> None:
        self._burst = float(rate.burst)
        self._per_s = rate.per_s
        self._tokens = float(rate.burst)
        self._at = time.monotonic()

    def spend(self) -> bool:
        now = time.monotonic()
        tokens = min(self._burst, self._tokens + (now - self._at) * self._per_s)
        self._at = now
        if tokens < 1.0:
            self._tokens = tokens
            return False
        self._tokens = tokens - 1.0
        return True

"""A raw HTTP/2 cleartext (h2c, prior knowledge) client for attacks curl and httpx cannot send:
request HEADERS without END_STREAM followed by trailers only, or any frame order we choose.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from routing.units import parse_hostport


@dataclass
class H2Response:
    status: int
    headers: dict[str, str]
    body: bytes
    trailers: dict[str, str] = field(default_factory=dict)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def h2_request(address: str, headers: list[tuple[str, str]], *, body: bytes | None = None,
               trailers: list[tuple[str, str]] | None = None, timeout_s: float = 15.0,
               ) -> H2Response:
    """One request on a fresh h2c connection to ``address`` (``host:port``).

    ``headers`` are the request's own (pseudo-headers included); ``body`` is sent as DATA when
    given (in as many frames as the server's frame size and flow control ask for); ``trailers``
    as a final HEADERS frame with END_STREAM. With neither, the HEADERS frame itself ends the
    stream.
    """
    host, port = parse_hostport(address)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        last_is_headers = body is None and trailers is None
        conn.send_headers(stream, headers, end_stream=last_is_headers)
        unsent = body or b""
        ending_data = body is not None and trailers is None
        if body == b"":
            conn.send_data(stream, b"", end_stream=ending_data)
        status, response_headers, chunks, response_trailers = 0, {}, [], {}
        done = False
        while not done:
            # The body goes out as flow control allows (frames of at most the peer's maximum
            # frame size), interleaved with reading the server's frames, WINDOW_UPDATEs
            # included; the server may answer (a 413) before all of it is sent.
            try:
                while unsent:
                    size = min(len(unsent), conn.max_outbound_frame_size,
                               conn.local_flow_control_window(stream))
                    if size <= 0:
                        break
                    piece, unsent = unsent[:size], unsent[size:]
                    conn.send_data(stream, piece, end_stream=ending_data and not unsent)
                if not unsent and trailers is not None:
                    conn.send_headers(stream, trailers, end_stream=True)
                    trailers = None
            except h2.exceptions.StreamClosedError:
                unsent, trailers = b"", None  # answered (and ended) before the body was all out
            sock.sendall(conn.data_to_send())
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection before answering")
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    response_headers = {_text(k): _text(v) for k, v in event.headers}
                    status = int(response_headers[":status"])
                elif isinstance(event, h2.events.DataReceived):
                    chunks.append(event.data)
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.TrailersReceived):
                    response_trailers = {_text(k): _text(v) for k, v in event.headers}
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    done = event.stream_id == stream
            sock.sendall(conn.data_to_send())
        conn.close_connection()
        sock.sendall(conn.data_to_send())
    return H2Response(status, response_headers, b"".join(chunks), response_trailers)


def h2_streams_until_reset(address: str, headers: list[tuple[str, str]], bodies: list[int],
                           timeout_s: float = 60.0) -> dict[int, int]:
    """Open one stream per entry of ``bodies`` on one h2c connection and send that many bytes
    on each (never ending them), as flow control allows, until the server has reset every
    stream. Returns stream id → the RST_STREAM error code; a stream the server never reset
    by ``timeout_s`` is missing (the timeout only ends a test that would hang)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    resets: dict[int, int] = {}
    with socket.create_connection(parse_hostport(address), timeout=timeout_s) as sock:
        conn.initiate_connection()
        unsent = {}
        for size in bodies:
            stream = conn.get_next_available_stream_id()
            conn.send_headers(stream, headers)
            unsent[stream] = size
        while len(resets) < len(bodies):
            for stream, left in unsent.items():
                size = min(left, conn.max_outbound_frame_size,
                           conn.local_flow_control_window(stream)) if stream not in resets else 0
                while size > 0:
                    conn.send_data(stream, b"x" * size)
                    unsent[stream] = left = left - size
                    size = min(left, conn.max_outbound_frame_size,
                               conn.local_flow_control_window(stream))
            sock.sendall(conn.data_to_send())
            data = sock.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.StreamReset):
                    resets[event.stream_id] = event.error_code
            sock.sendall(conn.data_to_send())
    return resets

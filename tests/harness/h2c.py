"""A raw HTTP/2 cleartext (h2c, prior knowledge) client for attacks curl and httpx cannot send:
request HEADERS without END_STREAM followed by trailers only, or any frame order we choose.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events

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
    given; ``trailers`` as a final HEADERS frame with END_STREAM. With neither, the HEADERS
    frame itself ends the stream.
    """
    host, port = parse_hostport(address)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        last_is_headers = body is None and trailers is None
        conn.send_headers(stream, headers, end_stream=last_is_headers)
        if body is not None:
            conn.send_data(stream, body, end_stream=trailers is None)
        if trailers is not None:
            conn.send_headers(stream, trailers, end_stream=True)
        sock.sendall(conn.data_to_send())
        status, response_headers, chunks, response_trailers = 0, {}, [], {}
        done = False
        while not done:
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

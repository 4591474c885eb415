"""The server's GOAWAY for each protocol violation of :mod:`.test_protocol` says which one in
its debug data, and names the last stream it took. Pinned exactly, so that a change to the frame
loop the server shares with the client (:mod:`sidecar_runtime.h2grpc.peer`) cannot change what
goes on the wire unseen."""

from __future__ import annotations

import pytest

from tests.sidecar_runtime.h2grpc.clients import FrameClient, goaway
from tests.sidecar_runtime.h2grpc.servicers import running_server
from tests.sidecar_runtime.h2grpc.test_protocol import VIOLATIONS

DEBUG = {
    "DATA on stream 0": "DATA on stream 0",
    "frame above 16384 bytes": "frame above SETTINGS_MAX_FRAME_SIZE",
    "PUSH_PROMISE": "a client cannot push",
    "CONTINUATION without HEADERS": "CONTINUATION without HEADERS",
    "HEADERS not continued": "a header block was not continued",
    "CONTINUATION of another stream": "CONTINUATION without HEADERS",
    "HEADERS on an even stream": "HEADERS on a server stream id",
    "DATA on an idle stream": "DATA on an idle stream",
    "HPACK index 0": "bad header block: InvalidTableIndex",
    "HPACK index past the tables": "bad header block: InvalidTableIndex",
    "HPACK string past the block": "bad header block: HPACKDecodingError",
    "header value not UTF-8": "bad header block: HPACKDecodingError",
    "padding longer than the frame": "bad padding",
    "WINDOW_UPDATE of 0 on the connection": "a WINDOW_UPDATE of 0",
    "connection window past 2^31-1": "window above 2^31-1",
    "INITIAL_WINDOW_SIZE past 2^31-1": "window above 2^31-1",
    "MAX_FRAME_SIZE below 16384": "a bad SETTINGS_MAX_FRAME_SIZE",
    "SETTINGS of odd length": "a malformed SETTINGS",
    "PING on a stream": "PING on a stream",
    "RST_STREAM on stream 0": "RST_STREAM on stream 0",
    "header block above 64 KiB": "header block too large",
}


def test_every_violation_has_its_debug_data() -> None:
    assert set(DEBUG) == set(VIOLATIONS)


@pytest.mark.parametrize("case", list(VIOLATIONS))
async def test_the_goaway_says_which_violation(case: str) -> None:
    build, code = VIOLATIONS[case]
    async with running_server() as running:
        client = await FrameClient.open(running.port)
        client.send(build(client))
        sent = goaway(await client.until_closed())
        await client.close()
    assert (sent.last_stream_id, sent.error_code, sent.additional_data.decode()) \
        == (0, code, DEBUG[case])


async def test_not_a_preface() -> None:
    async with running_server() as running:
        client = await FrameClient.open(running.port, preface=b"GET / HTTP/1.1\r\n\r\n" * 2)
        sent = goaway(await client.until_closed())
        await client.close()
    assert (sent.last_stream_id, sent.error_code, sent.additional_data) \
        == (0, 1, b"not an HTTP/2 connection preface")

"""The frames the server writes, byte for byte against hyperframe's (the reference the
test clients read with): the packed 9-byte header must say what the fields said one by one."""

from __future__ import annotations

import pytest
from hyperframe.frame import DataFrame, Frame, HeadersFrame, RstStreamFrame, WindowUpdateFrame

from sidecar_runtime.h2grpc import frames as f

MAX_STREAM = 0x7FFF_FFFF


@pytest.mark.parametrize(("stream", "size"), [
    (1, 0), (3, 1), (MAX_STREAM, 255), (257, 256), (65_537, 0xFFFF), (5, 0x10000),
    (7, f.DEFAULT_MAX_FRAME), (9, 0xFFFFFF),
])
def test_data_frame_header_is_the_fields_in_order(stream: int, size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    for end_stream in (False, True):
        reference = DataFrame(stream, payload, flags=["END_STREAM"] if end_stream else [])
        assert f.frame(f.DATA, f.END_STREAM if end_stream else 0, stream, payload) \
            == reference.serialize()


@pytest.mark.parametrize("frame", [
    f.headers(MAX_STREAM, f.RESPONSE_HEADERS, end_stream=False),
    f.headers(3, f.RESPONSE_HEADERS + f.TRAILERS_OK, end_stream=True),
    f.headers(1, f.trailers(13, "x" * 20_000), end_stream=True),  # HEADERS + CONTINUATION
    f.rst_stream(MAX_STREAM, f.CANCEL),
    f.window_update(0, 16 * 1024 * 1024 - f.DEFAULT_WINDOW),
    f.window_update(1 << 24, MAX_STREAM),
])
def test_frames_read_back_as_written(frame: bytes) -> None:
    """Every frame parses back to the bytes it came from (hyperframe re-serializes it)."""
    at, read = 0, []
    while at < len(frame):
        parsed, length = Frame.parse_frame_header(memoryview(frame[at:at + 9]))
        parsed.parse_body(memoryview(frame[at + 9:at + 9 + length]))
        read.append(parsed)
        at += 9 + length
    assert b"".join(each.serialize() for each in read) == frame
    assert isinstance(read[0], HeadersFrame | RstStreamFrame | WindowUpdateFrame)

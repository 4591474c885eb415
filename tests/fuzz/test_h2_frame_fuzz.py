"""Our HTTP/2 server's frame parser on hostile bytes (issue 33, item 6): arbitrary bytes, frames
with valid-looking headers and random payloads (and lengths that lie), and the generated gRPC
sequences of ``tests/fuzz/h2_frames_gen.py``, fed to one
:class:`~sidecar_runtime.h2grpc.connection.Connection` in-process.

Whatever comes in:

- no exception escapes ``data_received``, and none reaches the event loop (a callback, a call's
  task); no GOAWAY INTERNAL_ERROR, which is what the connection sends for a bug of its own;
- it writes only whole, well-formed frames, nothing once it has closed, at most one GOAWAY, and
  it never closes without one;
- where the reads break the bytes does not matter: the same bytes in one read and split at
  random points (read back to back) make it write the same bytes, GOAWAY and all.

Reads with the loop run between them (the handlers answer in between) are checked for the same
invariants, not for the same output: what a client sends after an answer it had not yet seen is
judged against a different stream state, as the RFC means it to be.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hyperframe.frame import DataFrame, GoAwayFrame, HeadersFrame, PingFrame
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.h2_frames_gen import (
    INTERNAL_ERROR,
    PREFACE,
    SETTINGS,
    Data,
    Headers,
    Op,
    Ours,
    Ping,
    frame,
    parse_frames,
    render,
    run,
    run_ours,
    sequences,
)

pytestmark = pytest.mark.fuzz

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
FUZZ = settings(max_examples=2000, deadline=None, derandomize=True, database=None,
                suppress_health_check=_HEALTH)
"""Derandomized: the same examples on every run, so a CI failure reproduces as it is. About
2 ms an example for the byte-level tests on one core."""
SEQUENCES = settings(FUZZ, max_examples=700)
"""The gRPC sequences cost ~10 ms each (some carry 4 MiB of DATA)."""

HELLO = PREFACE + frame(SETTINGS, 0, 0)
prefixes = st.sampled_from([HELLO, HELLO, HELLO, PREFACE, b""])
"""What comes before the fuzzed bytes: mostly a good preface and SETTINGS (else the first bytes
end the connection and the frame parser is never reached)."""

raw_frames = st.lists(st.tuples(
    st.integers(0, 12) | st.just(0xFF),  # type: every known one, two extensions, an unknown
    st.integers(0, 255),  # flags
    st.sampled_from([0, 1, 1, 2, 3, 5, 0x8000_0001, 0x7FFF_FFFF]),  # stream (reserved bit too)
    st.binary(max_size=48),
    st.sampled_from([0] * 8 + [-1, 1, 7, 16_385 - 48]),  # what the length field adds: a lie
), max_size=30)


def raw(frames: Sequence[tuple[int, int, int, bytes, int]]) -> bytes:
    out = bytearray()
    for kind, flags, stream, payload, lie in frames:
        length = max(0, len(payload) + lie)
        out += length.to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big")
        out += payload
    return bytes(out)


def chunked(data: bytes, cuts: Sequence[int]) -> list[bytes]:
    """``data`` split at ``cuts`` (offsets, any order, repeats allowed: an empty read)."""
    points = sorted(min(cut, len(data)) for cut in cuts)
    edges = [0, *points, len(data)]
    return [data[start:end] for start, end in itertools.pairwise(edges)]


def assert_sound(ours: Ours) -> None:
    """The invariants every run keeps, whatever it was fed."""
    sent = parse_frames(ours.transport.out)  # whole, well-formed frames only
    goaways = [f for f in sent if isinstance(f, GoAwayFrame)]
    assert len(goaways) <= 1, f"{len(goaways)} GOAWAYs"
    assert ours.transport.late_writes == 0, "a write after close()"
    assert ours.ended is None or ours.ended.code != -1, "closed without GOAWAY"
    assert ours.ended is None or ours.ended.code != INTERNAL_ERROR, str(ours.ended)


def same_whatever_the_reads(data: bytes, cuts: Sequence[int]) -> None:
    whole = run(run_ours([data]))
    split = run(run_ours(chunked(data, cuts)))
    assert_sound(whole)
    assert_sound(split)
    if not whole.transport.pauses and not split.transport.pauses:
        # (A read that yields the loop lets the handlers answer in between: the rest is
        # judged after their answers, as on a real socket.)
        assert split.transport.out == whole.transport.out, (
            f"one read: {whole.ended}; split at {sorted(cuts)}: {split.ended}")
    spun = run(run_ours(chunked(data, cuts), spin=True))
    assert_sound(spun)


cut_points = st.lists(st.integers(0, 5_000), max_size=24)


@FUZZ
@given(prefix=prefixes, tail=st.binary(max_size=600), cuts=cut_points)
def test_arbitrary_bytes(prefix: bytes, tail: bytes, cuts: list[int]) -> None:
    same_whatever_the_reads(prefix + tail, cuts)


@FUZZ
@given(prefix=prefixes, frames=raw_frames, cuts=cut_points)
def test_frames_with_random_payloads_and_lying_lengths(
        prefix: bytes, frames: list[tuple[int, int, int, bytes, int]], cuts: list[int]) -> None:
    same_whatever_the_reads(prefix + raw(frames), cuts)


@SEQUENCES
@given(sequence=sequences(max_ops=16), cuts=st.lists(st.integers(0, 10**7), max_size=24),
       bytewise=st.booleans())
def test_grpc_sequences_split_anywhere(sequence: tuple[bool, list[Op]], cuts: list[int],
                                       bytewise: bool) -> None:
    leading_settings, ops = sequence
    data = b"".join(element.data for element in render(ops, leading_settings))
    if bytewise and len(data) <= 4_096:
        cuts = list(range(1, len(data)))
    same_whatever_the_reads(data, cuts)


def test_a_read_that_yields_the_loop_reads_the_rest_after() -> None:
    """Past 2,000 header fields decoded, a read leaves the rest for the next loop iteration,
    reading paused: the rest is read then, and split reads come to the same end."""
    ops: list[Op] = [Headers(stream="new", block="many_fields", end_stream=True)] * 17
    ops.append(Ping())
    data = b"".join(element.data for element in render(ops))
    ours = run(run_ours([data]))
    assert_sound(ours)
    assert ours.transport.pauses >= 1
    assert isinstance(parse_frames(ours.transport.out)[-1], PingFrame)  # the last frame's ACK
    same_whatever_the_reads(data, [100, 5_000, 9_000])


def test_the_driver_serves_a_call() -> None:
    """The harness itself: a well-formed unary call, read with the loop running, is answered
    (headers, the echoed message, trailers), and the connection stays up."""
    ops: list[Op] = [Headers(stream="new", block="echo", end_stream=False),
                     Data(stream="open", size=11, end_stream=True)]
    ours = run(run_ours([element.data for element in render(ops)], spin=True))
    assert_sound(ours)
    assert ours.ended is None
    head, message, trailers = [f for f in parse_frames(ours.transport.out) if f.stream_id == 1]
    assert isinstance(head, HeadersFrame) and "END_STREAM" not in head.flags
    assert isinstance(message, DataFrame)
    assert message.data == b"\0\0\0\0\x06mmmmmm"  # the request's message, echoed
    assert isinstance(trailers, HeadersFrame) and "END_STREAM" in trailers.flags

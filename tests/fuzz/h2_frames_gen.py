"""HTTP/2 frame sequences for the h2grpc fuzz tests (``tests/fuzz/test_h2_*.py``), and our server's
:class:`~sidecar_runtime.h2grpc.connection.Connection` driven in-process on a fake transport.

A sequence is a list of *ops* (frozen dataclasses: what hypothesis draws, shrinks and prints) that
:func:`render` turns into *elements*: one whole frame each, its length field true to its payload (a
header block split over CONTINUATIONs, or a burst of DATA, is several elements). Both parsers then
see the same frame boundaries, and an outcome is pinned to the element whose read produced it.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import hpack
from hyperframe.frame import Frame, GoAwayFrame
from hypothesis import strategies as st

from sidecar_runtime.h2grpc import Server
from sidecar_runtime.h2grpc.connection import Connection
from tests.sidecar_runtime.h2grpc.servicers import MAX_RECEIVE, Servicer, path, register

T = TypeVar("T")
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION, ALTSVC = range(11)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
FRAME_SIZE_ERROR, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x6, 0x9, 0xB
MAX_FRAME = 16_384
CODE_NAMES = {0x0: "NO_ERROR", 0x1: "PROTOCOL_ERROR", 0x2: "INTERNAL_ERROR",
              0x3: "FLOW_CONTROL_ERROR", 0x5: "STREAM_CLOSED", 0x6: "FRAME_SIZE_ERROR",
              0x7: "REFUSED_STREAM", 0x8: "CANCEL", 0x9: "COMPRESSION_ERROR",
              0xB: "ENHANCE_YOUR_CALM"}
KIND_NAMES = ["DATA", "HEADERS", "PRIORITY", "RST_STREAM", "SETTINGS", "PUSH_PROMISE", "PING",
              "GOAWAY", "WINDOW_UPDATE", "CONTINUATION", "ALTSVC"]


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One frame: the 9-byte header (its length that of ``payload``), then ``payload``."""
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big")
            + payload)


@dataclass(frozen=True)
class Head:
    """An element's frame header, as both parsers read it (the reserved bit cut)."""

    length: int
    kind: int
    flags: int
    stream: int

    @property
    def name(self) -> str:
        return KIND_NAMES[self.kind] if self.kind < len(KIND_NAMES) else f"0x{self.kind:02x}"


def head(element: bytes) -> Head:
    return Head(int.from_bytes(element[:3], "big"), element[3], element[4],
                int.from_bytes(element[5:9], "big") & 0x7FFF_FFFF)


# -- HPACK by hand, for the blocks an encoder does not write ----------------------------------

def hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) whose first byte carries ``first``'s high bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes, indexed: bool = False) -> bytes:
    """A literal field with a literal name: with incremental indexing or without (§6.2)."""
    prefix = b"\x40" if indexed else b"\x00"
    return prefix + hpack_int(len(name), 7, 0) + name + hpack_int(len(value), 7, 0) + value


def grpc_request(method_path: str, method: str = "POST", **extra: str) -> list[tuple[str, str]]:
    return [(":method", method), (":scheme", "http"), (":path", method_path),
            (":authority", "fuzz"), ("content-type", "application/grpc"), ("te", "trailers"),
            *((name.replace("_", "-"), value) for name, value in extra.items())]


BlockKind = Literal["echo", "chat", "missing", "get", "timeout", "junk", "index0", "truncated",
                    "nonutf8", "bomb", "table_over", "table_zero", "empty_name", "many_fields",
                    "big_value"]
BLOCK_KINDS: tuple[BlockKind, ...] = ("echo", "chat", "missing", "get", "timeout", "junk", "index0",
                                      "truncated", "nonutf8", "bomb", "table_over", "table_zero",
                                      "empty_name", "many_fields", "big_value")


def header_block(kind: BlockKind, encoder: hpack.Encoder, junk: bytes) -> bytes:
    """A request's header block of ``kind``; the encoder's dynamic table is the sequence's."""
    echo = grpc_request(path("Echo"))
    if kind == "echo":
        return bytes(encoder.encode(echo))
    if kind == "chat":
        return bytes(encoder.encode(grpc_request(path("Chat"))))
    if kind == "missing":
        return bytes(encoder.encode(grpc_request(path("NoSuchMethod"))))
    if kind == "get":
        return bytes(encoder.encode(grpc_request(path("Echo"), method="GET")))
    if kind == "timeout":
        return bytes(encoder.encode(grpc_request(path("Echo"), grpc_timeout="5S")))
    if kind == "junk":
        return junk
    if kind == "index0":
        return b"\x80"  # index 0 (RFC 7541 §6.1: a decoding error)
    if kind == "truncated":
        return bytes(encoder.encode(echo))[:-1]
    if kind == "nonutf8":
        return bytes(encoder.encode(echo)) + literal(b"x-bad", b"\xff\xfe")
    if kind == "bomb":  # one 4 KB entry, then 20 one-byte references: an 80 KB header list
        return literal(b"x-bomb", b"b" * 4000, indexed=True) + b"\xbe" * 20
    if kind == "table_over":  # a dynamic table size update above the 4,096 bytes allowed
        return hpack_int(5000, 5, 0x20) + bytes(encoder.encode(echo))
    if kind == "table_zero":  # the dynamic table emptied (a size update to 0), back next block
        encoder.header_table_size = 0
        block = bytes(encoder.encode(echo))
        encoder.header_table_size = 4096
        return block
    if kind == "empty_name":
        return bytes(encoder.encode(echo)) + literal(b"", b"x")
    if kind == "many_fields":
        return bytes(encoder.encode(echo)) + b"".join(
            literal(f"x-f{n}".encode(), b"v") for n in range(120))
    assert kind == "big_value"
    return bytes(encoder.encode(echo)) + literal(b"x-big", b"v" * 20_000)


# -- ops ------------------------------------------------------------------------------------

StreamRef = Literal["new", "gap", "open", "first", "skipped", "even", "zero", "idle"]
"""Which stream a frame names: ``new`` the next odd id (a HEADERS opens it), ``gap`` one past it
(leaving ``skipped`` never used), ``open`` the last opened, ``first`` the first, ``idle`` an odd
id above all used, ``even`` a server's id, ``zero`` the connection."""
Pad = Literal["none", "some", "exact", "over", "empty"]
"""Padding: ``some`` 3 bytes, ``exact`` every byte after the Pad Length is padding, ``over`` a
Pad Length one past the payload, ``empty`` PADDED on an empty payload (no Pad Length at all)."""


@dataclass(frozen=True)
class Headers:
    stream: StreamRef
    block: BlockKind
    end_stream: bool
    continuations: int = 0
    unfinished: bool = False  # the block's last frame lacks END_HEADERS
    pad: Pad = "none"
    priority: Literal["none", "other", "self"] = "none"
    junk: bytes = b""


@dataclass(frozen=True)
class Data:
    stream: StreamRef
    size: int
    end_stream: bool = False
    pad: Pad = "none"
    content: Literal["message", "junk", "compressed", "huge"] = "message"


@dataclass(frozen=True)
class Burst:
    """``count`` full DATA frames on one stream, each a whole gRPC message: enough (257) to
    pass the 4 MiB stream window our server grants."""

    stream: StreamRef
    count: int
    end_stream: bool = False


@dataclass(frozen=True)
class WindowUpdate:
    stream: StreamRef
    increment: int
    length: int = 4


@dataclass(frozen=True)
class RstStream:
    stream: StreamRef
    code: int = 0x8
    length: int = 4


@dataclass(frozen=True)
class Ping:
    stream: StreamRef = "zero"
    length: int = 8
    ack: bool = False


@dataclass(frozen=True)
class Settings:
    entries: tuple[tuple[int, int], ...] = ()
    ack: bool = False
    stream: StreamRef = "zero"
    extra: int = 0  # bytes past the last whole entry


@dataclass(frozen=True)
class Priority:
    stream: StreamRef
    length: int = 5
    depends: Literal["other", "self"] = "other"


@dataclass(frozen=True)
class PushPromise:
    stream: StreamRef
    promised: int = 2


@dataclass(frozen=True)
class GoAway:
    stream: StreamRef = "zero"
    length: int = 8
    code: int = 0


@dataclass(frozen=True)
class Continuation:
    """A CONTINUATION no HEADERS asked for (unless a block is open on its stream)."""

    stream: StreamRef
    end_headers: bool = True


@dataclass(frozen=True)
class Unknown:
    kind: int
    flags: int
    stream: StreamRef
    payload: bytes = b""


@dataclass(frozen=True)
class Oversize:
    """A frame of ``length`` bytes (16,384 is the most a peer must take) of type ``kind``."""

    kind: int
    stream: StreamRef
    length: int


Op = (Headers | Data | Burst | WindowUpdate | RstStream | Ping | Settings | Priority | PushPromise
      | GoAway | Continuation | Unknown | Oversize)


@dataclass(frozen=True)
class Element:
    data: bytes
    op: int  # the op it was rendered from; -1 for the preface and the leading SETTINGS


@dataclass
class _Streams:
    highest: int = 0
    opened: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    def pick(self, ref: StreamRef, opening: bool = False) -> int:
        if ref in ("new", "gap", "idle"):
            step = 4 if ref == "gap" else 2
            stream = self.highest + step if self.highest else step - 1
            if opening:
                if ref == "gap":
                    self.skipped.append(stream - 2)
                self.highest = stream
                self.opened.append(stream)
            return stream
        if ref == "open":
            return self.opened[-1] if self.opened else 1
        if ref == "first":
            return self.opened[0] if self.opened else 1
        if ref == "skipped":
            return self.skipped[-1] if self.skipped else self.highest + 2 or 1
        if ref == "even":
            return self.highest + 1 if self.highest else 2
        return 0


def _padded(payload: bytes, pad: Pad) -> tuple[int, bytes]:
    """``payload`` with ``pad``'s padding; the flag to add."""
    if pad == "none":
        return 0, payload
    if pad == "some":
        return PADDED, b"\x03" + payload + b"\0\0\0"
    if pad == "exact":
        return PADDED, bytes((min(len(payload), 255),)) + payload
    if pad == "over":
        return PADDED, bytes((min(len(payload) + 1, 255),)) + payload
    return PADDED, b""


def _data_payload(size: int, content: str) -> bytes:
    if content == "junk" or size < 5:
        return bytes(n % 251 for n in range(size))
    flag = b"\x01" if content == "compressed" else b"\x00"
    length = b"\xff\xff\xff\xff" if content == "huge" else (size - 5).to_bytes(4, "big")
    return flag + length + b"m" * (size - 5)


def render(ops: Sequence[Op], leading_settings: bool = True) -> list[Element]:
    """The elements of a connection: the preface, SETTINGS (unless not ``leading_settings``),
    then each op's frames. A header block left open at the end is closed (an empty
    CONTINUATION with END_HEADERS), so that each parser judges it the same way."""
    elements = [Element(PREFACE, -1)]
    if leading_settings:
        elements.append(Element(frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 1_048_576)), -1))
    encoder = hpack.Encoder()
    streams = _Streams()
    open_block = 0  # the stream of a header block awaiting CONTINUATION
    for index, op in enumerate(ops):
        for data in _render_op(op, encoder, streams):
            elements.append(Element(data, index))
            h = head(data)
            if h.kind in (HEADERS, PUSH_PROMISE) and not h.flags & END_HEADERS:
                open_block = h.stream
            elif h.kind == CONTINUATION and h.flags & END_HEADERS:
                open_block = 0
    if open_block:
        elements.append(Element(frame(CONTINUATION, END_HEADERS, open_block), len(ops)))
    return elements


def _render_op(op: Op, encoder: hpack.Encoder, streams: _Streams) -> list[bytes]:
    if isinstance(op, Headers):
        stream = streams.pick(op.stream, opening=True)
        block = header_block(op.block, encoder, op.junk)
        parts = max(op.continuations + 1, -(-len(block) // (MAX_FRAME - 300)))
        size = -(-len(block) // parts) if block else 0
        chunks = [block[at:at + size] for at in range(0, len(block), size)] if size else [b""]
        chunks += [b""] * (parts - len(chunks))
        first = chunks[0]
        flags = END_STREAM if op.end_stream else 0
        if op.priority != "none":
            depends = stream if op.priority == "self" else 0
            first = depends.to_bytes(4, "big") + b"\x0f" + first
            flags |= PRIORITY_FLAG
        pad_flag, first = _padded(first, op.pad)
        flags |= pad_flag
        out = []
        for n, chunk in enumerate(chunks):
            last = n == len(chunks) - 1 and not op.unfinished
            if n == 0:
                out.append(frame(HEADERS, flags | (END_HEADERS if last else 0), stream, first))
            else:
                out.append(frame(CONTINUATION, END_HEADERS if last else 0, stream, chunk))
        return out
    if isinstance(op, Data):
        pad_flag, payload = _padded(_data_payload(op.size, op.content), op.pad)
        return [frame(DATA, pad_flag | (END_STREAM if op.end_stream else 0),
                      streams.pick(op.stream), payload)]
    if isinstance(op, Burst):
        stream = streams.pick(op.stream)
        payload = _data_payload(MAX_FRAME, "message")
        return [frame(DATA, END_STREAM if op.end_stream and n == op.count - 1 else 0, stream,
                      payload) for n in range(op.count)]
    if isinstance(op, WindowUpdate):
        payload = op.increment.to_bytes(4, "big")
        payload = payload[:op.length] if op.length <= 4 else payload + b"\0" * (op.length - 4)
        return [frame(WINDOW_UPDATE, 0, streams.pick(op.stream), payload)]
    if isinstance(op, RstStream):
        payload = op.code.to_bytes(4, "big")
        payload = payload[:op.length] if op.length <= 4 else payload + b"\0" * (op.length - 4)
        return [frame(RST_STREAM, 0, streams.pick(op.stream), payload)]
    if isinstance(op, Ping):
        return [frame(PING, ACK if op.ack else 0, streams.pick(op.stream),
                      bytes(range(op.length)))]
    if isinstance(op, Settings):
        payload = b"".join(struct.pack(">HI", key, value) for key, value in op.entries)
        return [frame(SETTINGS, ACK if op.ack else 0, streams.pick(op.stream),
                      payload + b"\0" * op.extra)]
    if isinstance(op, Priority):
        stream = streams.pick(op.stream)
        depends = stream if op.depends == "self" else 0
        payload = (depends.to_bytes(4, "big") + b"\x0f").ljust(op.length, b"\0")[:op.length]
        return [frame(PRIORITY, 0, stream, payload)]
    if isinstance(op, PushPromise):
        block = bytes(encoder.encode(grpc_request(path("Echo"))))
        return [frame(PUSH_PROMISE, END_HEADERS, streams.pick(op.stream),
                      op.promised.to_bytes(4, "big") + block)]
    if isinstance(op, GoAway):
        payload = (streams.highest.to_bytes(4, "big") + op.code.to_bytes(4, "big")
                   + b"debug")[:op.length]
        return [frame(GOAWAY, 0, streams.pick(op.stream), payload)]
    if isinstance(op, Continuation):
        return [frame(CONTINUATION, END_HEADERS if op.end_headers else 0,
                      streams.pick(op.stream), b"")]
    if isinstance(op, Unknown):
        return [frame(op.kind, op.flags, streams.pick(op.stream), op.payload)]
    assert isinstance(op, Oversize)
    return [frame(op.kind, 0, streams.pick(op.stream), b"\0" * op.length)]


# -- strategies -----------------------------------------------------------------------------

stream_refs: st.SearchStrategy[StreamRef] = st.sampled_from(
    ["new", "open", "open", "first", "gap", "skipped", "idle", "even", "zero"])
opening_refs: st.SearchStrategy[StreamRef] = st.sampled_from(
    ["new", "new", "new", "gap", "open", "first", "skipped", "even", "zero"])
pads: st.SearchStrategy[Pad] = st.sampled_from(["none", "none", "none", "some", "exact", "over",
                                                "empty"])
SETTING_VALUES = {
    0x1: [0, 4096, 2**32 - 1],  # HEADER_TABLE_SIZE
    0x2: [0, 1, 2],  # ENABLE_PUSH: only 0 and 1 (RFC 9113 §6.5.2)
    0x3: [0, 1, 100, 2**32 - 1],  # MAX_CONCURRENT_STREAMS
    0x4: [0, 1, 65_535, 2**31 - 1, 2**31, 2**32 - 1],  # INITIAL_WINDOW_SIZE
    0x5: [16_383, 16_384, 2**24 - 1, 2**24],  # MAX_FRAME_SIZE
    0x6: [0, 100, 2**32 - 1],  # MAX_HEADER_LIST_SIZE
    0x8: [0, 1],  # ENABLE_CONNECT_PROTOCOL (RFC 8441)
    0x9: [0, 1],  # NO_RFC7540_PRIORITIES (RFC 9218)
    0x0: [0, 7],
    0xF0F0: [0, 2**32 - 1],
}
setting_entries = st.sampled_from(sorted(SETTING_VALUES)).flatmap(
    lambda key: st.sampled_from(SETTING_VALUES[key]).map(lambda value: (key, value)))

headers_ops = st.builds(
    Headers, stream=opening_refs, block=st.sampled_from(BLOCK_KINDS), end_stream=st.booleans(),
    continuations=st.sampled_from([0, 0, 0, 1, 3, 9]),
    unfinished=st.sampled_from([False] * 7 + [True]), pad=pads.filter(lambda p: p != "empty"),
    priority=st.sampled_from(["none", "none", "other", "self"]),
    junk=st.binary(max_size=24))
data_ops = st.builds(
    Data, stream=stream_refs, size=st.sampled_from([0, 1, 5, 11, 300, 16_383, 16_384, 16_385]),
    end_stream=st.booleans(), pad=pads,
    content=st.sampled_from(["message", "message", "junk", "compressed", "huge"]))
hostile_ops: st.SearchStrategy[Op] = st.one_of(
    headers_ops, data_ops,
    st.builds(Burst, stream=stream_refs, count=st.sampled_from([2, 64, 256, 257]),
              end_stream=st.booleans()),
    st.builds(WindowUpdate, stream=stream_refs,
              increment=st.sampled_from([0, 1, 65_535, 2**31 - 1 - 65_535, 2**31 - 1,
                                         2**31 + 7, 2**32 - 1]),
              length=st.sampled_from([4, 4, 4, 3, 5])),
    st.builds(RstStream, stream=stream_refs, code=st.sampled_from([0, 1, 8, 0xFFFF]),
              length=st.sampled_from([4, 4, 4, 0, 5])),
    st.builds(Ping, stream=st.sampled_from(["zero", "zero", "zero", "open"]),
              length=st.sampled_from([8, 8, 8, 0, 7, 9]), ack=st.booleans()),
    st.builds(Settings, entries=st.lists(setting_entries, max_size=4).map(tuple)
              | st.lists(setting_entries, min_size=33, max_size=40).map(tuple),
              ack=st.sampled_from([False, False, True]),
              stream=st.sampled_from(["zero", "zero", "zero", "open"]),
              extra=st.sampled_from([0, 0, 0, 1, 5])),
    st.builds(Priority, stream=stream_refs, length=st.sampled_from([5, 5, 4, 6]),
              depends=st.sampled_from(["other", "other", "self"])),
    st.builds(PushPromise, stream=stream_refs, promised=st.sampled_from([2, 3])),
    st.builds(GoAway, stream=st.sampled_from(["zero", "zero", "open"]),
              length=st.sampled_from([8, 13, 7]), code=st.sampled_from([0, 1, 0xB])),
    st.builds(Continuation, stream=stream_refs, end_headers=st.booleans()),
    st.builds(Unknown, kind=st.sampled_from([0xA, 0xB, 0xC, 0x10, 0xF0, 0xFF]),
              flags=st.integers(0, 255), stream=stream_refs, payload=st.binary(max_size=16)),
    st.builds(Oversize, kind=st.sampled_from([DATA, HEADERS, PING, SETTINGS, 0xF0]),
              stream=stream_refs, length=st.sampled_from([16_384, 16_385, 20_000])),
)
"""Any op, most of them a protocol error of some kind."""

_on_open: st.SearchStrategy[StreamRef] = st.sampled_from(["open", "open", "first"])
benign_ops: st.SearchStrategy[Op] = st.one_of(
    st.builds(Headers, stream=st.sampled_from(["new", "new", "gap"]),
              block=st.sampled_from(["echo", "chat", "chat", "missing", "get", "timeout",
                                     "table_zero", "many_fields"]),
              end_stream=st.booleans(), continuations=st.sampled_from([0, 0, 0, 1, 3]),
              pad=st.sampled_from(["none", "none", "some"]),
              priority=st.sampled_from(["none", "none", "other"])),
    st.builds(Headers, stream=_on_open, block=st.just("echo"), end_stream=st.just(True)),
    st.builds(Data, stream=_on_open, size=st.sampled_from([0, 5, 11, 300, 16_380]),
              end_stream=st.booleans(), pad=st.sampled_from(["none", "none", "some", "exact"])),
    st.builds(Burst, stream=_on_open, count=st.sampled_from([2, 64, 256, 257]),
              end_stream=st.booleans()),
    st.builds(WindowUpdate, stream=st.sampled_from(["zero", "open"]),
              increment=st.sampled_from([1, 65_535, 2**20])),
    st.builds(RstStream, stream=_on_open, code=st.sampled_from([0, 8])),
    st.builds(Ping, ack=st.just(False)),
    st.builds(Settings, entries=st.lists(st.sampled_from([
        (0x1, 0), (0x1, 4096), (0x2, 0), (0x3, 100), (0x4, 0), (0x4, 65_535), (0x4, 2**31 - 1),
        (0x5, 16_384), (0x5, 2**24 - 1), (0x6, 100), (0xF0F0, 1)]), max_size=4).map(tuple),
              ack=st.sampled_from([False, False, True])),
    st.builds(Priority, stream=st.sampled_from(["open", "idle"])),
    st.builds(Unknown, kind=st.sampled_from([0xB, 0xF0]), flags=st.integers(0, 255),
              stream=st.sampled_from(["zero", "open"]), payload=st.binary(max_size=8)),
)
"""Ops a well-behaved client may send (on streams it may have closed meanwhile)."""

ops: st.SearchStrategy[Op] = st.sampled_from([False] * 5 + [True]).flatmap(
    lambda hostile: hostile_ops if hostile else benign_ops)
"""One op: five in six are benign, so that a sequence gets deep into a connection before
something ends it. (Not ``one_of(benign, benign, ..., hostile)``: hypothesis flattens nested
``one_of``s into one uniform choice among all their branches.)"""


def sequences(max_ops: int = 24) -> st.SearchStrategy[tuple[bool, list[Op]]]:
    """Whether the preface is followed by SETTINGS (mostly: its absence is itself a protocol
    error, RFC 9113 §3.4), and the ops after it: a call opened, then up to ``max_ops`` more."""
    opening = st.builds(Headers, stream=st.just("new"), block=st.sampled_from(["echo", "chat"]),
                        end_stream=st.just(False))
    return st.tuples(st.sampled_from([True] * 15 + [False]),
                     st.tuples(opening, st.lists(ops, min_size=2, max_size=max_ops))
                     .map(lambda parts: [parts[0], *parts[1]]))


# -- our server, in-process -----------------------------------------------------------------

class FakeTransport(asyncio.Transport):
    """What the connection writes, and whether it closed; ``connection_lost`` follows a close
    on the next loop iteration, as asyncio's transports do."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closing = False
        self.late_writes = 0  # writes after close()
        self.paused = False  # reading paused: no data_received until resumed
        self.pauses = 0
        self.protocol: Connection | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.closing:
            self.late_writes += 1
        self.out += data

    def close(self) -> None:
        if not self.closing and self.protocol is not None:
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 50_000) if name == "peername" else default

    def pause_reading(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        self.paused = False


def parse_frames(data: bytes | bytearray) -> list[Frame]:
    """The frames in what our server wrote (it writes whole, well-formed frames only)."""
    frames, at = [], 0
    while at < len(data):
        parsed, length = Frame.parse_frame_header(memoryview(bytes(data[at:at + 9])))
        parsed.parse_body(memoryview(bytes(data[at + 9:at + 9 + length])))
        frames.append(parsed)
        at += 9 + length
    assert at == len(data), "the server wrote part of a frame"
    return frames


@dataclass(frozen=True)
class Ended:
    """A connection ended by a connection error: at which element, with which code."""

    at: int
    code: int
    why: str

    def __str__(self) -> str:
        return f"element {self.at}: {CODE_NAMES.get(self.code, hex(self.code))} ({self.why})"


class Ours:
    """Our server's side of one connection, fed element by element inside a running loop."""

    def __init__(self) -> None:
        server = Server(max_receive_message_length=MAX_RECEIVE)
        register(server, Servicer())
        self.transport = FakeTransport()
        self.connection = Connection(server)
        self.transport.protocol = self.connection
        self.connection.connection_made(self.transport)
        self.read = 0  # bytes of transport.out parsed so far
        self.ended: Ended | None = None
        self.goaways: list[GoAwayFrame] = []

    def greeting(self) -> list[Frame]:
        """What the server wrote on connection_made (its SETTINGS, its window)."""
        return self.written()

    def feed(self, index: int, data: bytes) -> list[Frame]:
        """One read; the frames the server wrote in answer."""
        assert not self.transport.paused, "a read while reading is paused"
        self.connection.data_received(data)
        return self.written(index)

    def written(self, index: int = 0) -> list[Frame]:
        """The frames written since the last look (a GOAWAY among them ends the connection at
        element ``index``)."""
        out = self.transport.out
        frames = parse_frames(out[self.read:])
        self.read = len(out)
        for sent in frames:
            if isinstance(sent, GoAwayFrame):
                self.goaways.append(sent)
                if self.ended is None:
                    why = sent.additional_data.decode(errors="replace")
                    self.ended = Ended(index, sent.error_code, why)
        if self.ended is None and self.transport.closing:
            self.ended = Ended(index, -1, "closed without GOAWAY")
        return frames

    async def readable(self, index: int) -> list[Frame]:
        """Once the connection reads again (it pauses reading to yield the loop after a read
        that did much work), as a transport would; what it wrote meanwhile (its handlers run)."""
        for _ in range(100):
            if not self.transport.paused or self.transport.closing:
                break
            await asyncio.sleep(0)
        assert not self.transport.paused or self.transport.closing, "reading stays paused"
        return self.written(index)

    async def close(self, index: int) -> None:
        """Read what a yield left (as of element ``index``), close (if it did not) and let cut
        calls finish their tasks."""
        await self.readable(index)
        self.transport.close()
        for _ in range(5):
            await asyncio.sleep(0)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a fresh loop, without installing its SIGINT handler: on Python 3.11
    that formats the main task's repr (an enum lookup error message), and with it everything
    the coroutine holds: seconds per call for a 4 MiB burst of frames. Raises if anything
    reached the loop's exception handler (an exception in a callback or a call's task)."""
    loop = asyncio.new_event_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        result = loop.run_until_complete(coro)
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    assert not errors, f"the event loop saw: {errors}"
    return result


async def run_ours(chunks: Iterable[bytes], *, spin: bool = False) -> Ours:
    """Feed ``chunks`` as successive reads; with ``spin``, let the loop run between reads (the
    handlers answer in between) instead of reading them back to back."""
    ours = Ours()
    ours.greeting()
    index = 0
    for index, chunk in enumerate(chunks):
        await ours.readable(index)
        ours.feed(index, chunk)
        if spin:
            for _ in range(3):
                await asyncio.sleep(0)
    await ours.close(index)
    return ours

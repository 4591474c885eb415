"""The RLS request read from its bytes by hand: the same :class:`LimitRequest` as upb's parse and
:func:`ratelimit.rls_pb.request_from_proto`, for less CPU.

Reading a message through upb's Python API costs a wrapper object per field read; an admission
(6 descriptors) cost ~15 µs there, a settlement batch (60) ~215 µs (bench.ratelimit_python).
The messages Envoy and extproc send have a small, fixed shape: ``RateLimitRequest`` {1: domain,
2: repeated descriptor, 3: hits_addend}, ``RateLimitDescriptor`` {1: repeated entry, 3:
hits_addend as a ``UInt32Value`` {1: value}}, ``Entry`` {1: key, 2: value}. Those fields are read
here, in any order, each field that is not a repeated one at most once. Anything else (a limit
override, an unknown field, another wire type, a varint or a string that is not what upb would
accept, a field repeated that protobuf would merge, a request nearing a bound of
:mod:`ratelimit.request_bounds`) hands the whole message to
:func:`ratelimit.request_bounds.check`, which refuses it above a bound, then to upb and
``request_from_proto``: what is read here is what upb reads, and what upb refuses is refused
with upb's error. The work here is one step per descriptor and entry, within the bounds.

A descriptor without a lease (Envoy's ``kind=requests`` ones) is the same bytes call after call:
its :class:`DescriptorRequest` is kept per bytes. Entries are kept per bytes too (a settlement
batch repeats ``kind``, the level values, ``used`` and ``done``); a lease entry is not (each
request has its own).
"""

from __future__ import annotations

from typing import Any

from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit import request_bounds
from ratelimit.limiter import DescriptorRequest, LimitRequest, Phase
from ratelimit.request_bounds import (
    MAX_DESCRIPTORS,
    MAX_ENTRIES,
    MAX_ENTRIES_PER_DESCRIPTOR,
    MAX_REQUEST_BYTES,
    MAX_TEXT_BYTES,
)
from ratelimit.rls_pb import LEASE_VALUE, USED_VALUE, request_from_proto
from sidecar_runtime.wire.names import CONTROL_ENTRIES, LEASE_ENTRY, RELEASE_ENTRY, USED_ENTRY

MAX_KEPT = 4096
"""Descriptors, and apart entries, remembered by their bytes; past this many, afresh (a client
varying its values cannot grow them)."""
_MAX_KEPT_BYTES = 512
"""Longer descriptors and entries are read but not remembered."""
_descriptors: dict[bytes, tuple[DescriptorRequest, int]] = {}
"""A descriptor by its bytes, with its count of entries (control ones included)."""
_entries: dict[bytes, tuple[str, Any]] = {}
_UINT32 = 2**32


class _Unusual(Exception):
    """Not the shape read here: upb reads the message instead."""


class Unparsable(Exception):
    """upb refuses the bytes (the service answers INTERNAL, as for any message it cannot
    parse)."""


def request_from_bytes(raw: bytes) -> LimitRequest:
    """The request in ``raw``, as ``request_from_proto(RateLimitRequest.FromString(raw))``
    reads it; raises :class:`~ratelimit.errors.OutOfBounds` above a bound of
    :mod:`ratelimit.request_bounds` (found on the bytes, before upb reads them), and
    :class:`Unparsable` where upb raises."""
    try:
        return _request(raw)
    except Exception:  # _Unusual, a short message, bad UTF-8, anything: check, then upb
        pass
    scanned = request_bounds.check(raw)
    try:
        message = rls_pb2.RateLimitRequest.FromString(raw)
    except Exception:
        raise Unparsable("could not parse the request message") from None
    if not scanned:
        # upb read bytes the scan could not follow: their bounds are unknown, so they are
        # refused as upb refuses what it cannot read (no client of this service sends such).
        raise Unparsable("could not parse the request message")
    return request_from_proto(message)


# Each reader below reads a length-delimited field's span inline (tag, length, bounds): one
# helper for the three copies cost 1.5 µs per admission and ~30 µs per settlement batch of 60
# (bench.ratelimit_python, 9.4 -> 10.9 and 195 -> 225 µs to read them), more than upb's reading.


def _varint(raw: bytes, pos: int, end: int) -> tuple[int, int]:
    """A varint of at most 5 bytes (what a length or a uint32 needs) ending before ``end``:
    (value, position after it). Longer ones, and truncated ones, are left to upb."""
    value = shift = 0
    while pos < end and shift < 35:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _Unusual


def _request(raw: bytes) -> LimitRequest:
    end = len(raw)
    if end > MAX_REQUEST_BYTES:
        raise _Unusual
    pos = entries = 0
    domain: str | None = None
    hits_addend: int | None = None
    descriptors: list[DescriptorRequest] = []
    kept = _descriptors
    while pos < end:
        tag = raw[pos]
        if tag == 0x18:  # hits_addend: uint32 varint
            value, pos = _varint(raw, pos + 1, end)
            if value >= _UINT32 or hits_addend is not None:
                raise _Unusual
            hits_addend = value
            continue
        if tag != 0x12 and tag != 0x0A:
            raise _Unusual
        length = raw[pos + 1]
        if length < 0x80:
            pos += 2
        else:
            length, pos = _varint(raw, pos + 1, end)
        stop = pos + length
        if stop > end:
            raise _Unusual
        if tag == 0x0A:  # domain
            if domain is not None or length > MAX_TEXT_BYTES:
                raise _Unusual
            domain = raw[pos:stop].decode()
        else:
            if len(descriptors) >= MAX_DESCRIPTORS:
                raise _Unusual  # request_bounds.check refuses it
            part = raw[pos:stop]
            found = kept.get(part)
            if found is None:
                found = _descriptor(raw, pos, stop)
                if found[0].lease is None and length <= _MAX_KEPT_BYTES:
                    if len(kept) >= MAX_KEPT:
                        kept.clear()
                    kept[part] = found
            descriptors.append(found[0])
            entries += found[1]
            if entries > MAX_ENTRIES:
                raise _Unusual
        pos = stop
    return LimitRequest(domain or "", tuple(descriptors), hits_addend or 0)


def _descriptor(raw: bytes, pos: int, end: int) -> tuple[DescriptorRequest, int]:
    """As :func:`ratelimit.rls_pb._descriptor` reads a descriptor, from its bytes; and its count
    of entries."""
    entries: list[tuple[str, str]] = []
    count = 0
    lease: str | None = None
    phase: Phase = "admit"
    used: int | None = None
    hits: int | None = None
    kept = _entries
    while pos < end:
        tag = raw[pos]
        if tag != 0x0A and tag != 0x1A:
            raise _Unusual  # a limit override, an unknown field: upb reads it
        length = raw[pos + 1]
        if length < 0x80:
            pos += 2
        else:
            length, pos = _varint(raw, pos + 1, end)
        stop = pos + length
        if stop > end:
            raise _Unusual
        if tag == 0x1A:  # hits_addend: UInt32Value {1: value}; twice (merged): upb reads it
            if hits is not None:
                raise _Unusual
            hits = _uint32_value(raw, pos, stop)
            pos = stop
            continue
        count += 1
        if count > MAX_ENTRIES_PER_DESCRIPTOR:
            raise _Unusual
        part = raw[pos:stop]
        entry = kept.get(part)
        if entry is None:
            entry = _entry(raw, pos, stop)
            if entry[0] is not _LEASE_MARK and length <= _MAX_KEPT_BYTES:
                if len(kept) >= MAX_KEPT:
                    kept.clear()
                kept[part] = entry
        pos = stop
        mark = entry[0]
        if mark is _PLAIN:
            entries.append(entry[1])
        elif mark is _LEASE_MARK:
            lease = entry[1]
        elif mark is _USED_MARK:
            phase = "settle"
            used = entry[1]
        elif mark is _RELEASE_MARK and phase == "admit":
            phase = "release"
    return DescriptorRequest(tuple(entries), hits, None, lease, phase, used), count


def _uint32_value(raw: bytes, pos: int, end: int) -> int:
    """A ``UInt32Value`` of at most its one field."""
    if pos == end:
        return 0
    if raw[pos] != 0x08:
        raise _Unusual
    value, pos = _varint(raw, pos + 1, end)
    if value >= _UINT32 or pos != end:
        raise _Unusual
    return value


_PLAIN, _LEASE_MARK, _USED_MARK, _RELEASE_MARK, _OTHER = "plain", "lease", "used", "release", "other"


def _entry(raw: bytes, pos: int, end: int) -> tuple[str, Any]:
    """An entry as the descriptor reader uses it: ``(_PLAIN, (key, value))``, or a control
    entry's mark and its value as read (a lease that is not one, a ``used`` that is not a count:
    None). The key, then the value, each at most once, as protobuf writes them."""
    key = value = ""
    if pos < end and raw[pos] == 0x0A:
        length = raw[pos + 1]
        if length < 0x80:
            pos += 2
        else:
            length, pos = _varint(raw, pos + 1, end)
        stop = pos + length
        if stop > end or length > MAX_TEXT_BYTES:
            raise _Unusual
        key = raw[pos:stop].decode()
        pos = stop
    if pos < end and raw[pos] == 0x12:
        length = raw[pos + 1]
        if length < 0x80:
            pos += 2
        else:
            length, pos = _varint(raw, pos + 1, end)
        stop = pos + length
        if stop > end or length > MAX_TEXT_BYTES:
            raise _Unusual
        value = raw[pos:stop].decode()
        pos = stop
    if pos != end:
        raise _Unusual
    if key not in CONTROL_ENTRIES:
        return _PLAIN, (key, value)
    if key == LEASE_ENTRY:
        return _LEASE_MARK, value if LEASE_VALUE.match(value) else None
    if key == USED_ENTRY:
        return _USED_MARK, int(value) if USED_VALUE.match(value) else None
    return (_RELEASE_MARK if key == RELEASE_ENTRY else _OTHER), None

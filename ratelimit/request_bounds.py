"""The bounds of one ``ShouldRateLimit`` request, and the scan of its bytes that enforces them
before any of it is read.

Every count and size a request could grow without limit is bounded here, in one place: what the
service reads (:mod:`ratelimit.request_bytes`, and upb with
:func:`ratelimit.rls_pb.request_from_proto` for the unusual) is then bounded work, whatever a
client sends. The bounds are far above what Envoy and extproc send (each says why), so a request
above one is not traffic this gateway makes: the service refuses it with ``INVALID_ARGUMENT``
and the message of :class:`~ratelimit.errors.OutOfBounds`, which names the bound and its value.

:func:`check` walks the protobuf wire format (``RateLimitRequest`` {1: domain, 2: repeated
descriptor}, ``RateLimitDescriptor`` {1: repeated entry}, ``Entry`` {1: key, 2: value}; any
other field, known or not, is stepped over by its length) and stops at the first bound
exceeded, in byte order. It builds nothing: one step per field, at most :data:`MAX_FIELDS`.
The service's own reader (:mod:`ratelimit.request_bytes`) reads what Envoy and extproc send
without it, counting as it goes, and hands any request that nears a bound to it; upb reads a
request only after it passed.
"""

from __future__ import annotations

from collections.abc import Iterator

from ratelimit.errors import OutOfBounds

MAX_REQUEST_BYTES = 1024 * 1024
"""Bytes of one request. The largest real one, extproc's settlement batch of 256 descriptors
(:data:`extproc.settlements.MAX_BATCH_DESCRIPTORS`) of ~145 bytes each, is ~37 KB; even
:data:`MAX_DESCRIPTORS` such descriptors (~150 KB) leave a margin of 7. The server's own cap on
a message (4 MiB) stays the transport's; this one bounds what a call may make the reader do."""

MAX_DESCRIPTORS = 1024
"""Descriptors of one request. Envoy's admission carries at most 15 (3 levels x requests, tokens
and their stream-done twin, concurrency and its release: :func:`routing.ratelimits.route_rate_limits`),
extproc's settlement batches at most 256."""

MAX_ENTRIES_PER_DESCRIPTOR = 64
"""Entries of one descriptor. The routed ones carry at most 6 (the ``llm_sidecar.cap`` gate,
``kind``, the level, the lease, ``used`` and ``done``, or ``release``); envoyproxy/ratelimit
descriptor trees deeper than a few levels are not written by hand."""

MAX_ENTRIES = 8192
"""Entries of one request, all descriptors together. A settlement batch carries 256 x 5 =
1,280; :data:`MAX_DESCRIPTORS` descriptors of the routed shape (at most 6 entries) fit, so the
descriptor cap, not this one, is what a batch meets first."""

MAX_TEXT_BYTES = 1024
"""UTF-8 bytes of the domain, and of each entry's key and value. Real values are short: API key
ids (21), tenants (at most 64, :data:`routing.schema.TENANT_RULE`), model names (at most 127),
leases (at most 64), token counts (at most 16 digits). None of them comes from a client
unchecked, so no client can push one past this bound to make the call fail (and Envoy then
admit it under ``failure_mode_deny: false``)."""

MAX_FIELDS = 32_768
"""Protobuf fields of one request, counted in the request, its descriptors and their entries
(a group's fields too). Any request within the bounds above, written as protobuf writes it (no
field repeated that is not a repeated one, no unknown ones), has at most 2 + 2 x 1,024 + 3 x
8,192 = 26,626; this bound only meets the fields protobuf lets a client repeat or add, which
cost a step each to read (a mebibyte of them is half a million steps: ~120 ms of CPU)."""


class _Malformed(Exception):
    """Bytes the scan cannot follow (see :func:`check`)."""


def check(raw: bytes) -> bool:
    """Raise :class:`~ratelimit.errors.OutOfBounds` for the first bound ``raw`` exceeds (in
    byte order); at most :data:`MAX_FIELDS` steps, each a few bytecodes.

    True when the whole request was scanned; False when its bytes are not a protobuf message
    the scan can follow (truncated, a length past its message, wire type 6 or 7, a group end
    without its start): upb refuses those, and the caller must not read such bytes otherwise
    (what the scan could not walk, it has not bounded)."""
    size = len(raw)
    if size > MAX_REQUEST_BYTES:
        raise OutOfBounds(f"the request ({size:,} bytes) exceeds the bound of "
                          f"{MAX_REQUEST_BYTES:,} bytes per request")
    try:
        _request(raw)
    except (_Malformed, IndexError):
        return False
    return True


def _too_many_fields() -> OutOfBounds:
    return OutOfBounds(f"the request exceeds the bound of {MAX_FIELDS:,} protobuf fields "
                       "per request")


class _Scan:
    """One walk over a request's bytes, counting every field it steps on."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.fields = 0

    def spans(self, pos: int, end: int) -> Iterator[tuple[int, int, int]]:
        """``(tag, start, stop)`` of each length-delimited field of the message in
        ``raw[pos:end]``; the others are stepped over. Every field counts toward
        :data:`MAX_FIELDS`."""
        raw = self.raw
        while pos < end:
            self.fields += 1
            if self.fields > MAX_FIELDS:
                raise _too_many_fields()
            tag, pos = _varint(raw, pos, end)
            if tag & 7 != 2:
                pos, self.fields = _skip(raw, pos, end, tag, self.fields)
                continue
            length, pos = _varint(raw, pos, end)
            stop = pos + length
            if stop > end:
                raise _Malformed
            yield tag, pos, stop
            pos = stop


def _request(raw: bytes) -> None:
    scan = _Scan(raw)
    descriptors = entries = 0
    for tag, pos, stop in scan.spans(0, len(raw)):
        if tag == 0x12:
            descriptors += 1
            if descriptors > MAX_DESCRIPTORS:
                raise OutOfBounds(f"the request exceeds the bound of {MAX_DESCRIPTORS:,} "
                                  "descriptors per request")
            entries += _descriptor(scan, pos, stop, descriptors)
            if entries > MAX_ENTRIES:
                raise OutOfBounds(f"the request exceeds the bound of {MAX_ENTRIES:,} "
                                  "entries per request")
        elif tag == 0x0A and stop - pos > MAX_TEXT_BYTES:
            raise OutOfBounds(f"the domain exceeds the bound of {MAX_TEXT_BYTES:,} bytes")


def _descriptor(scan: _Scan, pos: int, end: int, number: int) -> int:
    """The entries of the descriptor in ``raw[pos:end]`` (the ``number``-th of its request),
    once its bounds are checked."""
    entries = 0
    for tag, start, stop in scan.spans(pos, end):
        if tag == 0x0A:
            entries += 1
            if entries > MAX_ENTRIES_PER_DESCRIPTOR:
                raise OutOfBounds(f"descriptor {number:,} exceeds the bound of "
                                  f"{MAX_ENTRIES_PER_DESCRIPTOR:,} entries per descriptor")
            _entry(scan, start, stop, number)
    return entries


def _entry(scan: _Scan, pos: int, end: int, number: int) -> None:
    """Check the entry in ``raw[pos:end]``: its key and value within :data:`MAX_TEXT_BYTES`."""
    for tag, start, stop in scan.spans(pos, end):
        if (tag == 0x0A or tag == 0x12) and stop - start > MAX_TEXT_BYTES:
            raise OutOfBounds(f"an entry {'key' if tag == 0x0A else 'value'} of descriptor "
                              f"{number:,} exceeds the bound of {MAX_TEXT_BYTES:,} bytes")


def _varint(raw: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` (at most 10 bytes, as protobuf allows): (value, position after)."""
    if pos < end and raw[pos] < 0x80:
        return raw[pos], pos + 1
    value = shift = 0
    while pos < end and shift < 70:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _Malformed


def _skip(raw: bytes, pos: int, end: int, tag: int, fields: int) -> tuple[int, int]:
    """The position after the value of a field of ``tag`` that is not length-delimited, and the
    fields counted so far; a group (wire type 3) is skipped to its matching end, nested ones
    too, each field inside counted."""
    groups: list[int] = []
    while True:
        wire = tag & 7
        if wire == 0:
            _, pos = _varint(raw, pos, end)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _varint(raw, pos, end)
            pos += length
        elif wire == 3:
            groups.append(tag >> 3)
        elif wire == 4 and groups and groups[-1] == tag >> 3:
            groups.pop()
        else:
            raise _Malformed  # 6, 7, or a group end that closes nothing
        if pos > end:
            raise _Malformed
        if not groups:
            return pos, fields
        fields += 1
        if fields > MAX_FIELDS:
            raise _too_many_fields()
        if pos >= end:
            raise _Malformed  # a group left open
        tag, pos = _varint(raw, pos, end)

"""The bounds of a ``ShouldRateLimit`` request (``ratelimit.request_bounds``): at each bound a
request is read (by the service's own reader when it has Envoy's shape), one past it is refused
with a message naming the bound and its value, the same whether the service's reader or upb
would have read it; and the ways protobuf lets a client hide what it sends (non-minimal tags,
groups, unknown and repeated fields) are counted all the same."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from envoy.service.ratelimit.v3 import rls_pb2

from bench.ratelimit_python import admission, settlement_batch
from ratelimit import request_bytes
from ratelimit.errors import OutOfBounds
from ratelimit.request_bounds import (
    MAX_DESCRIPTORS,
    MAX_ENTRIES,
    MAX_ENTRIES_PER_DESCRIPTOR,
    MAX_FIELDS,
    MAX_REQUEST_BYTES,
    MAX_TEXT_BYTES,
    check,
)
from ratelimit.request_bytes import Unparsable, request_from_bytes
from ratelimit.rls_pb import request_from_proto
from sidecar_runtime.wire import pb_write

DOMAIN = pb_write.string(1, "llm-sidecar")


def entry(key: str = "k", value: str = "v") -> bytes:
    return pb_write.field(1, pb_write.string(1, key) + pb_write.string(2, value))


def descriptor(*entries: bytes) -> bytes:
    return pb_write.field(2, b"".join(entries))


def request_of(size: int) -> bytes:
    """A request in Envoy's shape of exactly ``size`` bytes: descriptors of two 1,000-byte
    values, and a last one sized to fill it (``count`` goes down until one fits)."""
    filler = descriptor(entry("k", "v" * 1000), entry("k", "v" * 1000))
    lasts = [descriptor(*head, entry("k", "v" * n))
             for head in ((), (entry("k", "v" * 1000),)) for n in range(MAX_TEXT_BYTES + 1)]
    last = {len(raw): raw for raw in lasts}
    count = (size - len(DOMAIN)) // len(filler)
    while (size - len(DOMAIN) - count * len(filler)) not in last:
        count -= 1
    return DOMAIN + filler * count + last[size - len(DOMAIN) - count * len(filler)]


def entries_in_all(total: int) -> bytes:
    """``MAX_DESCRIPTORS`` descriptors holding ``total`` entries between them."""
    per, extra = divmod(total, MAX_DESCRIPTORS)
    return DOMAIN + b"".join(descriptor(*[entry(f"k{n}", "v")] * (per + (n < extra)))
                             for n in range(MAX_DESCRIPTORS))


def text(size: int) -> str:
    """``size`` UTF-8 bytes, two to a character where it can."""
    return "é" * (size // 2) + "a" * (size % 2)


BOUNDS: dict[str, tuple[Callable[[int], bytes], int, str]] = {
    # name: (request holding n of it, the bound, the message one past it gets)
    "request bytes": (request_of, MAX_REQUEST_BYTES,
                      f"the request ({MAX_REQUEST_BYTES + 1:,} bytes) exceeds the bound of "
                      "1,048,576 bytes per request"),
    "descriptors per request": (lambda n: DOMAIN + descriptor(entry()) * n, MAX_DESCRIPTORS,
                                "the request exceeds the bound of 1,024 descriptors per request"),
    "entries per descriptor": (lambda n: DOMAIN + descriptor(*[entry()] * n),
                               MAX_ENTRIES_PER_DESCRIPTOR,
                               "descriptor 1 exceeds the bound of 64 entries per descriptor"),
    "entries per request": (entries_in_all, MAX_ENTRIES,
                            "the request exceeds the bound of 8,192 entries per request"),
    "domain bytes": (lambda n: pb_write.string(1, text(n)) + descriptor(entry()),
                     MAX_TEXT_BYTES, "the domain exceeds the bound of 1,024 bytes"),
    "key bytes": (lambda n: DOMAIN + descriptor(entry(), entry(text(n), "v")), MAX_TEXT_BYTES,
                  "an entry key of descriptor 1 exceeds the bound of 1,024 bytes"),
    "value bytes": (lambda n: DOMAIN + descriptor(entry()) + descriptor(entry("k", text(n))),
                    MAX_TEXT_BYTES,
                    "an entry value of descriptor 2 exceeds the bound of 1,024 bytes"),
}


def upb_reading(raw: bytes) -> object:
    return request_from_proto(rls_pb2.RateLimitRequest.FromString(raw))


@pytest.mark.parametrize("name", list(BOUNDS))
def test_at_a_bound_a_request_is_read_and_one_past_it_is_refused_naming_the_bound(
        name: str) -> None:
    build, bound, message = BOUNDS[name]
    at, past = build(bound), build(bound + 1)
    assert check(at) is True
    assert request_from_bytes(at) == upb_reading(at)
    assert request_bytes._request(at) == upb_reading(at)  # Envoy's shape: read without upb
    with pytest.raises(OutOfBounds) as scanned:
        check(past)
    with pytest.raises(OutOfBounds) as read:
        request_from_bytes(past)
    assert str(scanned.value) == str(read.value) == message


UNKNOWN = b"\x48\x01"  # field 9, a varint: upb reads it, the service's reader hands it over


@pytest.mark.parametrize("name", list(BOUNDS))
def test_the_bounds_are_the_same_when_upb_reads_the_request(name: str) -> None:
    """An unknown field sends the request to upb: the same bounds, the same messages."""
    build, bound, message = BOUNDS[name]
    at = build(bound - len(UNKNOWN) if name == "request bytes" else bound) + UNKNOWN
    assert request_from_bytes(at) == upb_reading(at)
    past = UNKNOWN + build(bound + 1)
    with pytest.raises(OutOfBounds) as read:
        request_from_bytes(past)
    expected = message.replace(f"({MAX_REQUEST_BYTES + 1:,} bytes)",
                               f"({MAX_REQUEST_BYTES + 1 + len(UNKNOWN):,} bytes)")
    assert str(read.value) == expected


def test_fields_a_client_may_add_or_repeat_are_bounded_too() -> None:
    at = UNKNOWN * MAX_FIELDS
    assert request_from_bytes(at) == upb_reading(at)
    message = "the request exceeds the bound of 32,768 protobuf fields per request"
    for past in (UNKNOWN * (MAX_FIELDS + 1),
                 pb_write.field(1, b"") * (MAX_FIELDS + 1),  # the domain, again and again
                 descriptor(b"\x1a\x00" * MAX_FIELDS),  # a descriptor's hits_addend, merged
                 descriptor(pb_write.field(1, b"\x0a\x00" * MAX_FIELDS)),  # an entry's key
                 b"\x0b" + b"\x08\x00" * MAX_FIELDS + b"\x0c"):  # inside a group
        with pytest.raises(OutOfBounds) as read:
            request_from_bytes(past)
        assert str(read.value) == message


HIDDEN: dict[str, tuple[bytes, str]] = {
    "entries under non-minimal tags": (
        DOMAIN + pb_write.field(2, b"\x8a\x80\x00\x00" * (MAX_ENTRIES_PER_DESCRIPTOR + 1)),
        "descriptor 1 exceeds the bound of 64 entries per descriptor"),
    "descriptors under non-minimal tags": (
        DOMAIN + b"\x92\x00\x00" * (MAX_DESCRIPTORS + 1),
        "the request exceeds the bound of 1,024 descriptors per request"),
    "descriptors after a group": (
        b"\x0b\x13\x12\x00\x14\x0c" + b"\x12\x00" * (MAX_DESCRIPTORS + 1),
        "the request exceeds the bound of 1,024 descriptors per request"),
    "a long value after an unknown field in its entry": (
        descriptor(pb_write.field(1, b"\x18\x01" + pb_write.field(2, b"v" * 1025))),
        "an entry value of descriptor 1 exceeds the bound of 1,024 bytes"),
    "a long key repeated after a short one": (
        descriptor(pb_write.field(1, pb_write.field(1, b"k") + pb_write.field(1, b"k" * 1025))),
        "an entry key of descriptor 1 exceeds the bound of 1,024 bytes"),
    "a long domain before a short one": (
        pb_write.field(1, b"d" * 1025) + DOMAIN,
        "the domain exceeds the bound of 1,024 bytes"),
}


@pytest.mark.parametrize("name", list(HIDDEN))
def test_what_protobuf_lets_a_client_hide_is_counted(name: str) -> None:
    raw, message = HIDDEN[name]
    rls_pb2.RateLimitRequest.FromString(raw)  # upb would read it: the scan must not let it by
    with pytest.raises(OutOfBounds) as read:
        request_from_bytes(raw)
    assert str(read.value) == message


def test_a_hostile_descriptor_of_two_million_empty_entries_is_refused_at_once() -> None:
    """~4 MiB, what the server takes as a message: refused by its size; its first mebibyte,
    by its 65th entry. Neither builds an entry: the CPU bound is ~250 times what it takes."""
    huge = DOMAIN + descriptor(b"\x0a\x00" * 2_097_000)
    first = DOMAIN + descriptor(b"\x0a\x00" * (MAX_REQUEST_BYTES // 2 - 16))
    assert len(first) <= MAX_REQUEST_BYTES
    started = time.process_time()
    for raw, message in ((huge, f"the request ({len(huge):,} bytes) exceeds the bound of "
                                "1,048,576 bytes per request"),
                         (first, "descriptor 1 exceeds the bound of 64 entries per descriptor")):
        with pytest.raises(OutOfBounds) as read:
            request_from_bytes(raw)
        assert str(read.value) == message
    assert time.process_time() - started < 0.1


def test_what_envoy_and_extproc_send_is_far_within_the_bounds() -> None:
    for raw in (admission(), settlement_batch()):
        assert check(raw) is True
        assert request_bytes._request(raw) == upb_reading(raw)


@pytest.mark.parametrize("raw", [b"\x12", b"\x12\x05\x0a\x03", b"\x0e", b"\x0c", b"\x0b",
                                 b"\x0b\x14", b"\x48" + b"\xff" * 10 + b"\x01"])
def test_bytes_the_scan_cannot_follow_are_unparsable(raw: bytes) -> None:
    assert check(raw) is False
    with pytest.raises(Unparsable):
        request_from_bytes(raw)

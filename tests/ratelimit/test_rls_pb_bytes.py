"""The service reads requests and writes answers as bytes (``request_from_bytes``,
``response_bytes``): what it reads is what upb's parse and ``request_from_proto`` read, what it
writes is byte for byte upb's ``SerializeToString`` of ``response_to_proto``, bytes upb
refuses are refused, and a request above a bound of ``ratelimit.request_bounds`` (as upb's parse
counts it) is refused as out of bounds. Tables of what Envoy and extproc send, of what protobuf allows besides
(repeated, merged, unknown and reordered fields), of malformed bytes, and generated ones."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from envoy.type.v3 import ratelimit_unit_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.ratelimit_python import admission, settlement_batch
from ratelimit import request_bytes
from ratelimit.descriptors import Limit
from ratelimit.errors import OutOfBounds
from ratelimit.limiter import UNLIMITED_REMAINING, DescriptorOutcome, LimitOutcome, LimitRequest
from ratelimit.request_bounds import (
    MAX_DESCRIPTORS,
    MAX_ENTRIES,
    MAX_ENTRIES_PER_DESCRIPTOR,
    MAX_REQUEST_BYTES,
    MAX_TEXT_BYTES,
)
from ratelimit.request_bytes import Unparsable, request_from_bytes
from ratelimit.rls_pb import request_from_proto, response_bytes, response_to_proto
from sidecar_runtime.wire import pb_write
from sidecar_runtime.wire.names import DONE_ENTRY, LEASE_ENTRY, RELEASE_ENTRY, USED_ENTRY

LEASE = "0123456789abcdef01234567"
Reading = LimitRequest | str


def over_a_bound(raw: bytes, message: rls_pb2.RateLimitRequest) -> bool:
    """Whether upb's reading of ``raw`` exceeds a bound (counted on what upb built: the other
    side of the scan on the bytes)."""
    entries = [len(d.entries) for d in message.descriptors]
    texts = [message.domain] + [t for d in message.descriptors for e in d.entries
                                for t in (e.key, e.value)]
    return (len(raw) > MAX_REQUEST_BYTES or len(entries) > MAX_DESCRIPTORS
            or max(entries, default=0) > MAX_ENTRIES_PER_DESCRIPTOR or sum(entries) > MAX_ENTRIES
            or any(len(text.encode()) > MAX_TEXT_BYTES for text in texts))


def reference(raw: bytes) -> Reading:
    """upb's parse, the bounds counted on it, ``request_from_proto``."""
    try:
        message = rls_pb2.RateLimitRequest.FromString(raw)
    except Exception:
        return "unparsable"
    if over_a_bound(raw, message):
        return "out of bounds"
    return request_from_proto(message)


def read(raw: bytes) -> Reading:
    try:
        return request_from_bytes(raw)
    except Unparsable:
        return "unparsable"
    except OutOfBounds:
        return "out of bounds"


def same_reading(raw: bytes) -> Reading:
    expected = reference(raw)
    assert read(raw) == expected
    assert read(raw) == expected  # again, from what the first reading remembered
    return expected


def request(*descriptors: ratelimit_pb2.RateLimitDescriptor, domain: str = "llm-sidecar",
            hits_addend: int = 0) -> bytes:
    raw: bytes = rls_pb2.RateLimitRequest(domain=domain, descriptors=list(descriptors),
                                          hits_addend=hits_addend).SerializeToString()
    return raw


def descriptor(*entries: tuple[str, str], hits: int | None = None,
               limit: tuple[int, int] | None = None) -> ratelimit_pb2.RateLimitDescriptor:
    out = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries])
    if hits is not None:
        out.hits_addend.value = hits
    if limit is not None:
        out.limit.requests_per_unit, out.limit.unit = limit
    return out


def entry(key: bytes, value: bytes) -> bytes:
    return pb_write.field(1, pb_write.blob(1, key) + pb_write.blob(2, value))


def desc_bytes(*parts: bytes) -> bytes:
    return pb_write.field(2, b"".join(parts))


PLAIN = (("kind", "requests"), ("api_key", "k_0123"))
TOKENS = (("kind", "tokens"), ("tenant", "acme"))
MINUTE = ratelimit_unit_pb2.RateLimitUnit.MINUTE

SENT: dict[str, bytes] = {
    "an admission as the gateway sends it": admission(),
    "a settlement batch as extproc sends it": settlement_batch(),
    "empty": b"",
    "no domain": request(descriptor(*PLAIN), domain=""),
    "no descriptors": request(),
    "request hits_addend": request(descriptor(*PLAIN), hits_addend=7),
    "request hits_addend at the uint32 top": request(descriptor(*PLAIN), hits_addend=2**32 - 1),
    "descriptor hits_addend 0 is set, not absent": request(descriptor(*PLAIN, hits=0)),
    "descriptor hits_addend large": request(descriptor(*TOKENS, (LEASE_ENTRY, LEASE),
                                                       hits=2**32 - 1)),
    "a limit override": request(descriptor(*PLAIN, limit=(5, MINUTE))),
    "an override of an unknown unit": request(descriptor(*PLAIN, limit=(5, 0))),
    "an empty descriptor": request(descriptor()),
    "empty key and value": request(descriptor(("", ""), ("k", ""), ("", "v"))),
    "unicode": request(descriptor(("kind", "requests"), ("tenant", "café-☕-𝄞")), domain="dø"),
    "long values (two-byte lengths)": request(descriptor(("tenant", "t" * 300),
                                                        ("k", "v" * MAX_TEXT_BYTES))),
    "settle, release, done and bad control values": request(
        descriptor(*TOKENS, (LEASE_ENTRY, LEASE), (USED_ENTRY, "97"), (DONE_ENTRY, "1")),
        descriptor(*TOKENS, (LEASE_ENTRY, "short"), (USED_ENTRY, "-1")),
        descriptor(*TOKENS, (LEASE_ENTRY, LEASE), (RELEASE_ENTRY, "1"), (USED_ENTRY, "5\n")),
        descriptor(*TOKENS, (RELEASE_ENTRY, ""), (LEASE_ENTRY, LEASE), (LEASE_ENTRY, "bad!"))),
    "1024 descriptors": request(*[descriptor(("n", str(n))) for n in range(MAX_DESCRIPTORS)]),
    "1025 descriptors": request(*[descriptor(("n", str(n))) for n in range(MAX_DESCRIPTORS + 1)]),
    "1025 empty descriptors": b"\x12\x00" * (MAX_DESCRIPTORS + 1),
    "64 entries": request(descriptor(*[("n", str(n)) for n in range(MAX_ENTRIES_PER_DESCRIPTOR)])),
    "65 entries, out of bounds": request(
        descriptor(*[("n", str(n)) for n in range(MAX_ENTRIES_PER_DESCRIPTOR + 1)])),
    "8193 entries, out of bounds": request(*[descriptor(*[("n", str(n))] * 8)
                                             for n in range(MAX_ENTRIES // 8 - 1)],
                                           descriptor(*[("n", "")] * 9)),
    "a value of 1025 bytes, out of bounds": request(descriptor(("k", "v" * (MAX_TEXT_BYTES + 1)))),
    "a domain of 1025 bytes, out of bounds": request(domain="d" * (MAX_TEXT_BYTES + 1)),
}

ALLOWED: dict[str, bytes] = {
    # What protobuf allows besides what Envoy writes: upb's reading is the one to match.
    "the last domain wins": b"\x0a\x01a" + desc_bytes(entry(b"k", b"v")) + b"\x0a\x01b",
    "the last hits_addend wins": b"\x18\x05\x18\x09" + desc_bytes(),
    "non-minimal varints": b"\x18\x85\x80\x80\x00" + b"\x12\x88\x80\x00" + entry(b"k", b"v"),
    "a 10-byte hits_addend (upb keeps 32 bits)": b"\x18" + b"\xff" * 9 + b"\x01",
    "a hits_addend of 2**32 (upb keeps 32 bits)": b"\x18\x80\x80\x80\x80\x10",
    "descriptor hits_addend merged: the later value": desc_bytes(
        entry(b"k", b"v"), b"\x1a\x02\x08\x05", b"\x1a\x02\x08\x09"),
    "descriptor hits_addend merged: an empty one keeps the value": desc_bytes(
        b"\x1a\x02\x08\x05", entry(b"k", b"v"), b"\x1a\x00"),
    "descriptor hits_addend: an explicit 0": desc_bytes(b"\x1a\x02\x08\x00"),
    "descriptor hits_addend with an unknown field": desc_bytes(b"\x1a\x04\x08\x05\x10\x01"),
    "an entry's key and value reversed and repeated": desc_bytes(
        pb_write.field(1, b"\x12\x01v\x0a\x01k\x0a\x02kk")),
    "an unknown top-level varint": b"\x48\x01" + desc_bytes(entry(b"k", b"v")),
    "an unknown top-level string": b"\x7a\x03abc" + desc_bytes(entry(b"k", b"v")),
    "an unknown top-level fixed64 and fixed32": b"\x49" + b"\x00" * 8 + b"\x4d" + b"\x00" * 4,
    "an unknown field in a descriptor": desc_bytes(entry(b"k", b"v"), b"\x20\x01"),
    "an unknown field in an entry": desc_bytes(pb_write.field(1, b"\x0a\x01k\x18\x01")),
    "a big field number": b"\xfa\xff\xff\xff\x0f\x00" + desc_bytes(entry(b"k", b"v")),
    "domain with a varint wire type": b"\x08\x05",
    "hits_addend as a packed field": b"\x1a\x02\x05\x06",
    "descriptor hits_addend as a varint": desc_bytes(b"\x18\x05"),
    "entries with a varint wire type": desc_bytes(b"\x08\x05"),
    "a dynamic metadata-like override of 0 units": desc_bytes(b"\x12\x00"),
}

MALFORMED: dict[str, bytes] = {
    "a lone tag": b"\x12",
    "a length past the end": b"\x12\x05\x0a\x03",
    "a length past its descriptor": b"\x12\x03\x0a\x05\x0a\x03abc",
    "an entry's length past its descriptor": desc_bytes(b"\x0a\x04\x0a\x09k") + b"\x0a\x03abc",
    "a truncated varint": b"\x18\xff",
    "an 11-byte varint": b"\x18" + b"\xff" * 10 + b"\x01",
    "a huge length": b"\x0a\xff\xff\xff\xff\x0f",
    "field number 0": b"\x00\x01",
    "a group start": b"\x0b",
    "a group end": b"\x0c",
    "wire type 6": b"\x0e",
    "garbage": b"\xff\xfe\xfd garbage",
    "garbage entry": b"\x12\x05\x0a\x03\xff\xfe",
}

BAD_UTF8 = (b"\xff", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xed\xbf\xbf",
            b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xe2\x82", b"\x80", b"a\xf0\x9f\x98")
GOOD_UTF8 = (b"\x00", b"\x7f", b"\xc2\x80", b"\xef\xbf\xbf", b"\xf0\x90\x80\x80",
             b"\xf4\x8f\xbf\xbf", b"\xee\x80\x80")


@pytest.mark.parametrize("name", [*SENT, *ALLOWED, *MALFORMED])
def test_a_request_reads_as_upb_reads_it(name: str) -> None:
    raw = {**SENT, **ALLOWED, **MALFORMED}[name]
    got = same_reading(raw)
    if name in MALFORMED:
        assert got == "unparsable"
    if name.startswith("1025") or name.endswith("out of bounds"):
        assert got == "out of bounds"


@pytest.mark.parametrize("text", BAD_UTF8 + GOOD_UTF8)
@pytest.mark.parametrize("where", ["domain", "key", "value"])
def test_text_upb_refuses_is_refused_and_text_it_reads_is_read_alike(text: bytes,
                                                                   where: str) -> None:
    if where == "domain":
        raw = pb_write.field(1, text)
    else:
        raw = desc_bytes(entry(text, b"v") if where == "key" else entry(b"k", text))
    assert (same_reading(raw) == "unparsable") is (text in BAD_UTF8)


def test_what_envoy_and_extproc_send_is_read_without_upb() -> None:
    """The shapes on the hot path are read here (else the service pays upb and this reader)."""
    for raw in (admission(), settlement_batch(), SENT["settle, release, done and bad control values"],
                SENT["unicode"], SENT["long values (two-byte lengths)"]):
        assert request_bytes._request(raw) == reference(raw)


def test_every_truncation_and_byte_change_of_an_admission_reads_as_upb_reads_it() -> None:
    raw = admission()
    for end in range(len(raw)):
        same_reading(raw[:end])
    rng = random.Random(16)
    for _ in range(2000):
        mutated = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        same_reading(bytes(mutated))


_TEXT = st.text(max_size=12)
_DESCRIPTORS = st.lists(st.tuples(
    st.lists(st.tuples(st.sampled_from(["kind", "api_key", LEASE_ENTRY, USED_ENTRY, RELEASE_ENTRY,
                                        DONE_ENTRY]) | _TEXT,
                       st.sampled_from([LEASE, "97", "1", "requests"]) | _TEXT), max_size=5),
    st.none() | st.integers(0, 2**32 - 1)), max_size=6)


@settings(max_examples=300, deadline=None)
@given(_DESCRIPTORS, _TEXT, st.integers(0, 2**32 - 1), st.binary(max_size=8), st.integers(0, 64))
def test_generated_requests_and_their_corruptions_read_as_upb_reads_them(
        descriptors: list[tuple[list[tuple[str, str]], int | None]], domain: str,
        hits_addend: int, noise: bytes, at: int) -> None:
    raw = request(*[descriptor(*entries, hits=hits) for entries, hits in descriptors],
                  domain=domain, hits_addend=hits_addend)
    same_reading(raw)
    at = min(at, len(raw))
    same_reading(raw[:at] + noise + raw[at:])
    same_reading(raw[:at] + noise)


def test_what_is_remembered_stays_bounded() -> None:
    for n in range(request_bytes.MAX_KEPT + 10):
        same_reading(request(descriptor(("kind", "requests"), ("api_key", f"k{n}"))))
    assert len(request_bytes._descriptors) <= request_bytes.MAX_KEPT
    assert len(request_bytes._entries) <= request_bytes.MAX_KEPT
    same_reading(request(descriptor(("kind", "requests"), ("api_key", "x" * 600))))
    assert all(len(raw) <= 512 for raw in request_bytes._descriptors)


# -- answers ---------------------------------------------------------------------------------

PER_SECOND = Limit("a", 10, "second", name="per-second")
BURSTY = Limit("b", 100, "minute", burst=300)
FIVE_MINUTES = Limit("c", 7, "minute", unit_multiplier=5)  # shown rounded per day
UNLIMITED = Limit("d", 1, "second", unlimited=True)
NAMELESS = Limit("e", 2**31, "hour")
TOKENS_LIMIT = Limit("f", 100_000, "minute", name="tokens", concurrent=0)
ZERO = Limit("g", 0, "second")
LIMITS = (PER_SECOND, BURSTY, FIVE_MINUTES, UNLIMITED, NAMELESS, TOKENS_LIMIT, ZERO, None)


def outcome_status(limit: Limit | None, remaining: int | None, reset_s: float | None,
                   code: str = "ok", kind: str = "requests") -> DescriptorOutcome:
    return DescriptorOutcome("ok" if code == "ok" else "over_limit", limit, remaining, reset_s,
                             0.5, "api_key", kind, code)


def same_answer(outcome: LimitOutcome) -> None:
    def run(fn: Callable[[], bytes]) -> bytes | type[BaseException]:
        try:
            return fn()
        except Exception as exc:
            return type(exc)
    expected = run(lambda: response_to_proto(outcome).SerializeToString())
    assert run(lambda: response_bytes(outcome)) == expected
    assert run(lambda: response_bytes(outcome)) == expected  # from what is remembered


REMAINING = (None, 0, 1, 4, 127, 128, 250, 2**31, UNLIMITED_REMAINING, 2**40)
RESETS = (None, 0.0, 0.0001, 0.6, 1.0, 1.5, 127.0, 128.0, 86400.5, 1e12, -0.5, -2.0, 2.0**63,
          math.inf, math.nan)


@pytest.mark.parametrize("limit", LIMITS, ids=lambda limit: getattr(limit, "full_key", "none"))
def test_a_status_is_written_as_upb_writes_it(limit: Limit | None) -> None:
    for remaining in REMAINING:
        for reset_s in RESETS:
            for code in ("ok", "over_limit"):
                status = outcome_status(limit, remaining, reset_s, code)
                same_answer(LimitOutcome(True, (status,)))


DENIED = outcome_status(PER_SECOND, 0, 2.0, "over_limit")
OUTCOMES: dict[str, LimitOutcome] = {
    "no statuses": LimitOutcome(True, ()),
    "an admission": LimitOutcome(True, (
        outcome_status(PER_SECOND, 4, 0.6), outcome_status(BURSTY, 250, 30.0, kind="tokens"),
        outcome_status(None, None, None), outcome_status(UNLIMITED, UNLIMITED_REMAINING, None))),
    "over limit, retry after": LimitOutcome(False, (outcome_status(BURSTY, 3, 1.0), DENIED),
                                            3, DENIED),
    "over limit, retry after 1 second": LimitOutcome(False, (DENIED,), 1, DENIED),
    "over limit, never": LimitOutcome(False, (DENIED,), 0, DENIED, never=True, needed=5000),
    "backend failed, deny": LimitOutcome(False, (
        outcome_status(PER_SECOND, None, None, "backend_deny"),), 1, None, backend_failed=True),
    "backend failed, allow": LimitOutcome(True, (
        outcome_status(PER_SECOND, None, None, "backend_allow"),), backend_failed=True),
    "concurrency": LimitOutcome(False, (
        outcome_status(Limit("h", 0, "second", concurrent=2), 0, 0.0, "over_limit",
                       "concurrent"),), 1,
        outcome_status(Limit("h", 0, "second", concurrent=2), 0, 0.0, "over_limit",
                       "concurrent")),
    "a limit name UTF-8 cannot carry (upb refuses it too)": LimitOutcome(True, (
        outcome_status(Limit("s", 10, "second", name="per-\ud800"), 4, 0.6),)),
    "a hundred statuses (two-byte lengths)": LimitOutcome(True, tuple(
        outcome_status(LIMITS[n % len(LIMITS)], n * 1000, n / 3) for n in range(100))),
}


@pytest.mark.parametrize("name", list(OUTCOMES))
def test_an_answer_is_written_as_upb_writes_it(name: str) -> None:
    same_answer(OUTCOMES[name])

"""``request_from_proto``: what a descriptor's entries come to, control entries included, for the
inputs Envoy and extproc send and for hostile ones a client could steer into them."""

from __future__ import annotations

import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from envoy.type.v3 import ratelimit_unit_pb2

from ratelimit.limiter import DescriptorRequest, Override
from ratelimit.request_bounds import MAX_ENTRIES_PER_DESCRIPTOR, MAX_TEXT_BYTES
from ratelimit.request_bytes import request_from_bytes
from ratelimit.rls_pb import request_from_proto
from sidecar_runtime.wire.names import DONE_ENTRY, LEASE_ENTRY, RELEASE_ENTRY, USED_ENTRY

LEASE = "0123456789abcdef01234567"
PLAIN = (("kind", "tokens"), ("api_key", "k1"))


def parsed(*entries: tuple[str, str], hits: int | None = None,
           limit: tuple[int, int] | None = None) -> DescriptorRequest:
    message = rls_pb2.RateLimitRequest(domain="d", hits_addend=3)
    descriptor = message.descriptors.add()
    for key, value in entries:
        entry = descriptor.entries.add()
        entry.key, entry.value = key, value
    if hits is not None:
        descriptor.hits_addend.value = hits
    if limit is not None:
        descriptor.limit.requests_per_unit, descriptor.limit.unit = limit
    # Through the wire format, as the service receives it; read from the bytes as the service
    # reads them, the same (tests/ratelimit/test_rls_pb_bytes.py holds the two readings equal).
    raw = message.SerializeToString()
    request = request_from_proto(rls_pb2.RateLimitRequest.FromString(raw))
    assert request_from_bytes(raw) == request
    assert request.domain == "d" and request.hits_addend == 3
    (only,) = request.descriptors
    return only


CASES: dict[str, tuple[tuple[tuple[str, str], ...], DescriptorRequest]] = {
    "plain": (PLAIN, DescriptorRequest(PLAIN)),
    "no entries": ((), DescriptorRequest(())),
    "lease taken out, wherever it sits": (
        (("kind", "tokens"), (LEASE_ENTRY, LEASE), ("api_key", "k1")),
        DescriptorRequest(PLAIN, lease=LEASE)),
    "settle: lease, used, done": (
        (*PLAIN, (LEASE_ENTRY, LEASE), (USED_ENTRY, "97"), (DONE_ENTRY, "1")),
        DescriptorRequest(PLAIN, lease=LEASE, phase="settle", used=97)),
    "release": ((*PLAIN, (LEASE_ENTRY, LEASE), (RELEASE_ENTRY, "1")),
                DescriptorRequest(PLAIN, lease=LEASE, phase="release")),
    "used wins over release, before it": (
        (*PLAIN, (USED_ENTRY, "5"), (RELEASE_ENTRY, "1")),
        DescriptorRequest(PLAIN, phase="settle", used=5)),
    "used wins over release, after it": (
        (*PLAIN, (RELEASE_ENTRY, "1"), (USED_ENTRY, "5")),
        DescriptorRequest(PLAIN, phase="settle", used=5)),
    "the last lease counts": (
        (*PLAIN, (LEASE_ENTRY, LEASE), (LEASE_ENTRY, "x" * 8)),
        DescriptorRequest(PLAIN, lease="x" * 8)),
    "a bad last lease is no lease": (
        (*PLAIN, (LEASE_ENTRY, LEASE), (LEASE_ENTRY, "bad lease!")),
        DescriptorRequest(PLAIN)),
    "a lease too short": ((*PLAIN, (LEASE_ENTRY, "1234567")), DescriptorRequest(PLAIN)),
    "a lease too long": ((*PLAIN, (LEASE_ENTRY, "a" * 65)), DescriptorRequest(PLAIN)),
    "the last used counts": ((*PLAIN, (USED_ENTRY, "5"), (USED_ENTRY, "7")),
                             DescriptorRequest(PLAIN, phase="settle", used=7)),
    "used not a count": ((*PLAIN, (USED_ENTRY, "-5")),
                         DescriptorRequest(PLAIN, phase="settle", used=None)),
    "used in other digits": ((*PLAIN, (USED_ENTRY, "\u0661\u0662")),
                             DescriptorRequest(PLAIN, phase="settle", used=None)),
    "used above 16 digits": ((*PLAIN, (USED_ENTRY, "1" * 17)),
                             DescriptorRequest(PLAIN, phase="settle", used=None)),
    "used with a trailing newline (the pattern's $ allows it)": (
        (*PLAIN, (USED_ENTRY, "42\n")), DescriptorRequest(PLAIN, phase="settle", used=42)),
    "done alone changes nothing but is taken out": ((*PLAIN, (DONE_ENTRY, "1")),
                                                    DescriptorRequest(PLAIN)),
    "a control name as a value is an ordinary entry": (
        (("kind", LEASE_ENTRY), ("api_key", USED_ENTRY)),
        DescriptorRequest((("kind", LEASE_ENTRY), ("api_key", USED_ENTRY)))),
    "as many entries as a descriptor may carry, each value as long as it may be": (
        tuple((f"k{n}", "v" * MAX_TEXT_BYTES) for n in range(MAX_ENTRIES_PER_DESCRIPTOR)),
        DescriptorRequest(tuple((f"k{n}", "v" * MAX_TEXT_BYTES)
                                for n in range(MAX_ENTRIES_PER_DESCRIPTOR)))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_descriptor_comes_to_its_entries_and_control_values(name: str) -> None:
    entries, expected = CASES[name]
    assert parsed(*entries) == expected


def test_hits_addend_and_an_override_limit_are_read_when_set() -> None:
    assert parsed(*PLAIN, hits=0).hits == 0
    assert parsed(*PLAIN, hits=120).hits == 120
    assert parsed(*PLAIN).hits is None
    minute = ratelimit_unit_pb2.RateLimitUnit.MINUTE
    assert parsed(*PLAIN, limit=(5, minute)).override == Override(5, "minute")
    unknown = ratelimit_unit_pb2.RateLimitUnit.UNKNOWN
    assert parsed(*PLAIN, limit=(5, unknown)).override is None


def test_descriptors_keep_their_order() -> None:
    message = rls_pb2.RateLimitRequest(domain="d", descriptors=[
        ratelimit_pb2.RateLimitDescriptor(entries=[
            ratelimit_pb2.RateLimitDescriptor.Entry(key="n", value=str(n))]) for n in range(50)])
    got = request_from_proto(message).descriptors
    assert [d.entries for d in got] == [(("n", str(n)),) for n in range(50)]

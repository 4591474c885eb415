"""The rate-limit requests extproc writes by hand (:func:`extproc.adapters.rls_pb.payload`: settlement
batches and cache-hit checks) are the message upb builds: the same bytes, and parsed back the
same message, whatever the entries hold."""

from __future__ import annotations

import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

from extproc.actions import Descriptor
from extproc.adapters import rls_pb
from routing.ratelimits import DOMAIN
from sidecar_runtime.wire.names import DONE_ENTRY, LEASE_ENTRY, USED_ENTRY


def built(descriptors: tuple[Descriptor, ...], domain: str = DOMAIN) -> rls_pb2.RateLimitRequest:
    """The message as upb builds it, entry by entry: what the payload must equal."""
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=[
        ratelimit_pb2.RateLimitDescriptor(entries=[
            ratelimit_pb2.RateLimitDescriptor.Entry(key=key, value=value)
            for key, value in descriptor])
        for descriptor in descriptors])


def settle(level: str, value: str, lease: str = "0123456789abcdef01234567",
           used: str = "88") -> Descriptor:
    return (("kind", "tokens"), (level, value), (LEASE_ENTRY, lease), (USED_ENTRY, used),
            (DONE_ENTRY, "1"))


CASES: dict[str, tuple[Descriptor, ...]] = {
    "none": (),
    "one settlement": (settle("api_key", "k_0123"), settle("tenant", "acme"),
                       settle("model", "llama-2-13b")),
    "non-ASCII value and key": (settle("tenant", "café-ü-日本"), (("ключ", "värde"),)),
    "value of 127 bytes": (settle("tenant", "t" * 127),),
    "value of 128 bytes (2-byte length)": (settle("tenant", "t" * 128),),
    "entry of 128 bytes": ((("k", "v" * 123),),),
    "value of 20,000 bytes (3-byte length)": (settle("tenant", "é" * 10_000),),
    "empty value": (settle("tenant", ""), (("kind", ""),)),
    "empty key": ((("", "value"),),),
    "empty key and value": ((("", ""),),),
    "no entries": ((), settle("tenant", "acme"), ()),
    "used 0": (settle("tenant", "acme", used="0"),),
    "many descriptors": tuple(settle(level, f"v{i}", lease=f"{i:024x}", used=str(i))
                              for i in range(300) for level in ("api_key", "tenant", "model")),
    "a descriptor past 16 KiB": (tuple((f"key{i}", "x" * 200) for i in range(100)),),
}


@pytest.mark.parametrize("descriptors", CASES.values(), ids=CASES.keys())
def test_the_payload_is_the_message_upb_builds(descriptors: tuple[Descriptor, ...]) -> None:
    expected = built(descriptors)
    for _ in range(2):  # the second time from the cache of encoded entries
        payload = rls_pb.settle_payload(descriptors)
        assert payload == expected.SerializeToString()
        assert rls_pb2.RateLimitRequest.FromString(payload) == expected


@pytest.mark.parametrize("domain", ["llm-sidecar", "", "d" * 200, "dömäin"])
def test_a_check_names_its_own_domain(domain: str) -> None:
    descriptors = CASES["one settlement"]
    assert rls_pb.payload(domain, descriptors) == built(descriptors, domain).SerializeToString()


def test_the_cache_of_entries_stays_bounded_and_right_past_its_size() -> None:
    descriptors = tuple(settle("api_key", f"k{i}", lease=f"{i:024x}") for i in range(5000))
    payload = rls_pb.settle_payload(descriptors)
    assert len(rls_pb._entries) <= rls_pb._ENTRY_CACHE
    assert payload == built(descriptors).SerializeToString()
    assert rls_pb.settle_payload(descriptors[:3]) == built(descriptors[:3]).SerializeToString()

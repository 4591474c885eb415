"""A request's head: grpc-timeout, metadata, and the cache of blocks decoded without the HPACK
dynamic table (unit tables, no server)."""

from __future__ import annotations

import hpack
import pytest

from sidecar_runtime.h2grpc.head import RequestHead, head_decoder, parse_timeout, request_head

GRPC = [(":method", "POST"), (":scheme", "http"), (":path", "/pkg.Svc/Call"),
        (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")]


@pytest.mark.parametrize(("value", "seconds"), [
    ("50m", 0.05), ("1S", 1.0), ("2M", 120.0), ("1H", 3600.0), ("100u", 1e-4), ("7n", 7e-9),
    ("12345678S", 12345678.0),
    ("", None), ("S", None), ("123456789S", None), ("10", None), ("10x", None), ("-1S", None),
    ("1.5S", None), ("²S", None), ("\uff11S", None), (" 1S", None),
])
def test_grpc_timeout(value: str, seconds: float | None) -> None:
    assert parse_timeout(value) == (pytest.approx(seconds) if seconds is not None else None)


def test_metadata_is_every_header_but_the_pseudo_and_the_transport_ones() -> None:
    head = request_head([*GRPC, ("grpc-timeout", "20m"), ("x-tenant", "a"),
                         ("user-agent", "envoy"), ("grpc-accept-encoding", "gzip")])
    assert head == RequestHead("POST", "/pkg.Svc/Call", "application/grpc", 20 * 1e-3,
                               (("x-tenant", "a"), ("user-agent", "envoy")), malformed=False)


def test_an_empty_header_name_makes_the_head_malformed() -> None:
    assert request_head([*GRPC, ("", "x")]).malformed


def test_blocks_are_cached_only_once_the_client_gave_up_the_dynamic_table() -> None:
    cache: dict[bytes, tuple[int, RequestHead]] = {}
    heads, encoder = head_decoder(cache), hpack.Encoder()
    first = encoder.encode(GRPC)  # the default table: entries indexed, later blocks refer to them
    again = encoder.encode(GRPC)
    assert heads.decode(first).path == heads.decode(again).path == "/pkg.Svc/Call"
    assert cache == {}  # a block that refers to the table means something else later
    encoder.header_table_size = 0  # what the client does after our SETTINGS_HEADER_TABLE_SIZE 0
    sized = encoder.encode(GRPC)  # starts with the table size update
    plain = encoder.encode(GRPC)
    assert sized != plain
    assert heads.decode(sized).path == "/pkg.Svc/Call"
    assert heads.decode(plain) is heads.decode(plain)  # the second time: looked up
    assert plain in cache

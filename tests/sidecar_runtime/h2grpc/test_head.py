"""A request's head: grpc-timeout, metadata, and the cache of blocks decoded without the HPACK
dynamic table (unit tables, no server)."""

from __future__ import annotations

import hpack
import pytest

from sidecar_runtime.h2grpc.head import (
    HEAD_CACHED_MAX_HELD,
    BlockCache,
    RequestHead,
    head_decoder,
    parse_timeout,
    request_head,
)

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
    heads, encoder = head_decoder(cache, [0], max_list=16_384, max_bytes=1 << 20), hpack.Encoder()
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


def _zero_table_encoder(heads: BlockCache[RequestHead]) -> hpack.Encoder:
    """An encoder that gave the dynamic table up, its size update read by ``heads``."""
    encoder = hpack.Encoder()
    encoder.header_table_size = 0
    heads.decode(encoder.encode([]))  # the table size update goes out once, first
    return encoder


def test_a_small_block_that_decodes_to_many_fields_is_never_cached() -> None:
    """1,000 one-byte static-table references (2 KB with the path) are ~200 KB of Python
    objects: decoded each time, never kept process-wide."""
    cache: dict[bytes, tuple[int, RequestHead]] = {}
    heads = head_decoder(cache, [0], max_list=64 * 1024, max_bytes=1 << 20)
    bomb = _zero_table_encoder(heads).encode(GRPC) + b"\x90" * 1000  # index 16: accept-encoding
    head = heads.decode(bomb)
    assert head.fields == len(GRPC) + 1000
    assert head.held > HEAD_CACHED_MAX_HELD
    assert cache == {}


def test_the_heads_cache_is_bounded_in_bytes_not_only_in_blocks() -> None:
    cache: dict[bytes, tuple[int, RequestHead]] = {}
    total = [0]
    heads = head_decoder(cache, total, max_list=64 * 1024, max_bytes=20_000)
    encoder = _zero_table_encoder(heads)
    for n in range(200):
        heads.decode(encoder.encode([*GRPC, ("x-n", "v" * 500 + str(n))]))
        assert total[0] <= 20_000
        assert total[0] == sum(len(block) + held.held for block, (_, held) in cache.items())
    assert 0 < len(cache) < 200


def test_a_header_list_above_the_servers_limit_is_a_decoding_error() -> None:
    heads = head_decoder({}, [0], max_list=1024, max_bytes=1 << 20)
    block = _zero_table_encoder(heads).encode([*GRPC, ("x-big", "v" * 2000)])
    with pytest.raises(hpack.HPACKError):
        heads.decode(block)

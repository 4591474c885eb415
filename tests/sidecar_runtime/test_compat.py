"""The private APIs we reach for, on the versions pyproject.toml pins: each compat module still
finds them and they still mean what the code relies on. A failure here names the library to pin
or the code to change; it is not a flake."""

from __future__ import annotations

import dataclasses
from typing import Any

import hpack
import pytest
from redis.asyncio.cluster import ClusterNode, NodesManager
from redis.exceptions import ResponseError

from extproc.quick_init import quick_init
from sidecar_runtime.compat import dataclass_internals, hpack_internals, redis_internals


def test_the_factory_sentinel_is_what_dataclasses_shows_in_a_signature() -> None:
    @dataclasses.dataclass(frozen=True)
    class Value:
        items: list[int] = dataclasses.field(default_factory=list)

    @quick_init
    @dataclasses.dataclass(frozen=True)
    class Quick:
        items: list[int] = dataclasses.field(default_factory=list)

    assert repr(dataclass_internals.DEFAULT_FACTORY) == "<factory>"
    assert Value.__init__.__defaults__ == Quick.__init__.__defaults__
    assert Quick().items == [] and Quick().items is not Quick().items


def test_an_initvar_is_told_from_a_field_and_a_classvar() -> None:
    @dataclasses.dataclass(frozen=True)
    class WithInitVar:
        seed: dataclasses.InitVar[int]

    @dataclasses.dataclass(frozen=True)
    class Plain:
        value: int
        kind: Any = "x"

    assert dataclass_internals.has_initvar(WithInitVar)
    assert not dataclass_internals.has_initvar(Plain)
    with pytest.raises(TypeError, match="InitVar"):
        quick_init(WithInitVar)


def test_redis_parse_error_gives_redis_pys_own_exceptions() -> None:
    error = redis_internals.BaseParser.parse_error("ERR unknown command")
    assert isinstance(error, ResponseError) and "unknown command" in str(error)
    encoder = redis_internals.Encoder("utf-8", "strict", False)
    assert encoder.encode("é") == "é".encode() and encoder.encode(3) == b"3"


def test_the_slot_map_is_read_from_redis_pys_nodes_manager() -> None:
    nodes = NodesManager([ClusterNode("127.0.0.1", 7000)], False, {})
    owner = ClusterNode("127.0.0.1", 7001)
    nodes.slots_cache[42] = [owner]
    assert redis_internals.slot_owners(nodes) == {42: [owner]}


def test_the_hpack_table_state_follows_what_a_block_adds() -> None:
    decoder = hpack.Decoder()
    assert hpack_internals.table_state(decoder) == (True, 4096)
    decoder.decode(bytes([0x82]))  # ":method: GET", static index 2: the table stays empty
    assert hpack_internals.table_state(decoder) == (True, 4096)
    decoder.decode(hpack.Encoder().encode([("x-tenant", "a")]))  # literal with indexing
    assert hpack_internals.table_state(decoder)[0] is False

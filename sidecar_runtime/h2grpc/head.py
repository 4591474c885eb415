"""A call's request head: its header block decoded (HPACK) and read as gRPC reads it.

The server asks the client for an HPACK table of 0 bytes (SETTINGS_HEADER_TABLE_SIZE). Once the
client has signalled that, a block means the same whenever it comes, so a repeated one (every
call from Envoy carries the same headers) is looked up rather than decoded and parsed again:
``hpack`` takes ~16 µs for Envoy's 8 gRPC headers, about what the rest of a message costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

import hpack

from sidecar_runtime.compat.hpack_internals import table_state

Metadata = tuple[tuple[str, str], ...]
T = TypeVar("T")

MAX_HEADER_LIST = 64 * 1024
"""The client's bound on an answer's header list and block (the server's is its
:class:`~.limits.Limits`)."""
HEADS_CACHED = 1024
HEAD_CACHED_MAX_BYTES = 2048  # Envoy's gRPC heads are ~100-250 bytes
HEAD_CACHED_MAX_HELD = 8 * 1024
"""A decoded head held above this (Envoy's are ~1-2 KB) is not cached: 2 KB of one-byte
static-table references decode to ~2,000 fields, ~300 KB of Python objects."""
FIELD_OVERHEAD = 160
"""What a header field costs in Python beyond its characters: a tuple (56 bytes) and two
``str`` objects (49 each), rounded up; RFC 7541's 32 is a C server's estimate."""
_NOT_METADATA = frozenset(("te", "content-type", "grpc-timeout", "grpc-encoding",
                           "grpc-accept-encoding"))
_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


@dataclass(frozen=True, slots=True)
class RequestHead:
    method: str
    path: str
    content_type: str
    timeout_s: float | None
    metadata: Metadata
    malformed: bool
    """A header with an empty name (RFC 9113 §8.2.1): a stream error, that stream only."""
    fields: int = field(default=0, compare=False)
    """How many fields the block carried."""
    held: int = field(default=0, compare=False)
    """What the head holds in memory, in bytes (:data:`FIELD_OVERHEAD` per field kept)."""


def parse_timeout(value: str) -> float | None:
    """``grpc-timeout`` (``50m``, ``1S``, ...) in seconds; None when malformed."""
    digits = value[:-1]
    # isascii too: str.isdigit() takes '²' (which int() refuses), int() fullwidth digits.
    if not 1 <= len(digits) <= 8 or value[-1:] not in _UNITS or not digits.isascii() \
            or not digits.isdigit():
        return None
    return int(digits) * _UNITS[value[-1]]


def request_head(headers: list[tuple[str, str]]) -> RequestHead:
    method = path = content_type = timeout = ""
    metadata: list[tuple[str, str]] = []
    held = FIELD_OVERHEAD
    for name, value in headers:
        if not name:
            return RequestHead("", "", "", None, (), malformed=True, fields=len(headers))
        if name[0] == ":":
            if name == ":path":
                path = value
            elif name == ":method":
                method = value
        elif name == "content-type":
            content_type = value
        elif name == "grpc-timeout":
            timeout = value
        elif name not in _NOT_METADATA:
            metadata.append((name, value))
            held += FIELD_OVERHEAD + len(name) + len(value)
    return RequestHead(method, path, content_type, parse_timeout(timeout) if timeout else None,
                       tuple(metadata), malformed=False, fields=len(headers),
                       held=held + len(path))


class BlockCache(Generic[T]):
    """One connection's HPACK decoder, whose blocks are looked up when that is safe: a block
    decoded with the dynamic table empty, which left it empty at the same size, neither read
    nor wrote the table, so it means the same whenever it comes. That holds for a peer that
    gave the table up (the server asks for 0 bytes in SETTINGS_HEADER_TABLE_SIZE) and for one
    that sends literals only (our server's answers, to the client). Any other block is decoded,
    since decoding updates the table, even for a stream refused afterwards, or for trailers.

    ``read`` turns a block's fields into what is kept; ``cache`` may be shared by connections
    (the server's heads), at most ``limit`` blocks of at most ``max_block`` bytes: 1,024 blocks
    of up to 64 KiB each would be 64 MiB of keys. With ``held`` (what a value holds, in bytes),
    a value above ``max_held`` is not cached and the cache is emptied before it would hold more
    than ``max_bytes`` (keys and values): a small block can decode to a large value."""

    def __init__(self, read: Callable[[list[tuple[str, str]]], T],
                 cache: dict[bytes, tuple[int, T]], limit: int, max_block: int, *,
                 max_list: int = MAX_HEADER_LIST, held: Callable[[T], int] | None = None,
                 max_held: int = 0, max_bytes: int = 0, cache_bytes: list[int] | None = None,
                 ) -> None:
        self._decoder = hpack.Decoder(max_header_list_size=max_list)
        self._read = read
        self._cache = cache
        self._limit = limit
        self._max_block = max_block
        self._held = held
        self._max_held = max_held
        self._max_bytes = max_bytes
        self._bytes = cache_bytes if cache_bytes is not None else [0]
        """The cache's bytes, shared as the cache is (one cell)."""

    def decode(self, block: bytes) -> T:
        """What ``block`` carries. Raises ``hpack.HPACKError`` (a connection error)."""
        decoder = self._decoder
        empty, size = table_state(decoder)
        if empty:
            found = self._cache.get(block)
            if found is not None and found[0] == size:
                return found[1]
        value = self._read(cast(list[tuple[str, str]], decoder.decode(block)))
        if empty and table_state(decoder) == (True, size) \
                and len(block) <= self._max_block:
            self._keep(block, size, value)
        return value

    def _keep(self, block: bytes, size: int, value: T) -> None:
        cost = len(block)
        if self._held is not None:
            held = self._held(value)
            if held > self._max_held:
                return
            cost += held
        total = self._bytes
        if len(self._cache) >= self._limit \
                or (self._max_bytes and total[0] + cost > self._max_bytes):
            self._cache.clear()
            total[0] = 0
        self._cache[block] = (size, value)
        total[0] += cost


def _head_held(head: RequestHead) -> int:
    return head.held


def head_decoder(cache: dict[bytes, tuple[int, RequestHead]], cache_bytes: list[int], *,
                 max_list: int, max_bytes: int) -> BlockCache[RequestHead]:
    """A server connection's decoder of request heads, with the server's cache of them (at most
    ``max_bytes``, counted in ``cache_bytes``), reading header lists up to ``max_list``."""
    return BlockCache(request_head, cache, HEADS_CACHED, HEAD_CACHED_MAX_BYTES,
                      max_list=max_list, held=_head_held, max_held=HEAD_CACHED_MAX_HELD,
                      max_bytes=max_bytes, cache_bytes=cache_bytes)

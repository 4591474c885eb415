"""The memory backend: bounded in bytes, least recently used out first, entries expire."""

from __future__ import annotations

from extproc.cache.store import ENTRY_OVERHEAD_BYTES, MemoryVectorStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cost(key: str, value: bytes) -> int:
    return len(key) + len(value) + ENTRY_OVERHEAD_BYTES


async def test_get_and_set_in_one_call_each() -> None:
    store = MemoryVectorStore(1 << 20)
    await store.set_many([("a", b"1"), ("b", b"22")], ttl_s=60)
    assert await store.get_many(["b", "x", "a"]) == [b"22", None, b"1"]
    assert store.bytes == cost("a", b"1") + cost("b", b"22")


async def test_bounded_in_bytes_least_recently_used_goes_first() -> None:
    value = b"v" * 100
    store = MemoryVectorStore(3 * cost("k0", value))
    await store.set_many([("k0", value), ("k1", value), ("k2", value)], ttl_s=60)
    assert await store.get_many(["k0"]) == [value]  # k0 is now the most recent
    await store.set_many([("k3", value)], ttl_s=60)
    assert await store.get_many(["k0", "k1", "k2", "k3"]) == [value, None, value, value]
    assert store.bytes <= store.max_bytes and len(store) == 3


async def test_an_entry_larger_than_the_whole_store_is_not_kept() -> None:
    store = MemoryVectorStore(500)
    await store.set_many([("small", b"x")], ttl_s=60)
    await store.set_many([("huge", b"x" * 1000)], ttl_s=60)
    assert await store.get_many(["small", "huge"]) == [b"x", None]


async def test_overwrite_replaces_and_keeps_the_byte_count_right() -> None:
    store = MemoryVectorStore(1 << 20)
    await store.set_many([("a", b"1" * 50)], ttl_s=60)
    await store.set_many([("a", b"2")], ttl_s=60)
    assert await store.get_many(["a"]) == [b"2"] and store.bytes == cost("a", b"2")


async def test_entries_expire_after_their_ttl() -> None:
    clock = Clock()
    store = MemoryVectorStore(1 << 20, clock)
    await store.set_many([("a", b"1")], ttl_s=10)
    clock.now += 9.9
    assert await store.get_many(["a"]) == [b"1"]
    clock.now += 0.1
    assert await store.get_many(["a"]) == [None]
    assert store.bytes == 0 and len(store) == 0

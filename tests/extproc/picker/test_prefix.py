from __future__ import annotations

import tracemalloc

import pytest

from extproc.picker.prefix import (
    BLOCK_BYTES,
    MAX_BLOCKS,
    MAX_PODS_PER_BLOCK,
    PrefixIndex,
    block_hashes,
)

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def text(seed: int, blocks: int) -> bytes:
    """``blocks`` full blocks, every block distinct from other seeds' and from its neighbours."""
    return b"".join(f"{seed:08d}/{i:08d}|".encode().ljust(BLOCK_BYTES, b"x") for i in range(blocks))


@pytest.mark.parametrize(("size", "count"), [
    (0, 0), (BLOCK_BYTES - 1, 0), (BLOCK_BYTES, 1), (BLOCK_BYTES * 3 + 17, 3),
    (BLOCK_BYTES * MAX_BLOCKS, MAX_BLOCKS), (1 << 20, MAX_BLOCKS),
])
def test_full_blocks_are_hashed_up_to_the_cap(size: int, count: int) -> None:
    assert len(block_hashes(b"a" * size)) == count


def test_a_megabyte_prompt_reads_only_its_first_blocks() -> None:
    head = text(1, MAX_BLOCKS)
    huge = head + b"z" * (1 << 20)
    assert block_hashes(huge) == block_hashes(head)
    index = PrefixIndex()
    index.record("pool", block_hashes(huge), A)
    assert len(index) == MAX_BLOCKS


def test_hashes_are_chained_so_a_block_stands_for_its_whole_prefix() -> None:
    first = block_hashes(text(1, 2) + text(3, 2))
    shared_head = block_hashes(text(1, 2) + text(4, 2))
    other_head = block_hashes(text(2, 2) + text(3, 2))
    assert first[:2] == shared_head[:2] and first[2:] != shared_head[2:]
    # The same bytes in blocks 2..3 after a different head hash differently.
    assert not set(first) & set(other_head)


def test_a_salt_starts_a_chain_of_its_own() -> None:
    """vLLM mixes a request's ``cache_salt`` into its first block: a pod's blocks of one salt
    never serve another, so the index must not send one tenant after another's prefix."""
    prompt = text(1, 3)
    plain, acme, other = (block_hashes(prompt, salt=s) for s in (None, "acme", "other"))
    assert plain == block_hashes(prompt)  # no salt: as before
    assert block_hashes(prompt, salt="acme") == acme
    assert not set(plain) & set(acme) and not set(acme) & set(other)
    assert block_hashes(b"a" * (BLOCK_BYTES - 1), salt="acme") == []
    index = PrefixIndex()
    index.record("pool", acme, A)
    assert index.match("pool", acme) == {A: 1.0}
    assert index.match("pool", other) == {} and index.match("pool", plain) == {}


def test_match_is_the_share_of_leading_blocks_each_pod_served() -> None:
    index = PrefixIndex()
    index.record("pool", block_hashes(text(1, 4)), A)
    index.record("pool", block_hashes(text(1, 2)), B)
    assert index.match("pool", block_hashes(text(1, 4))) == {A: 1.0, B: 0.5}
    # A longer prompt that starts like A's: A holds its first 4 blocks of 8.
    assert index.match("pool", block_hashes(text(1, 4) + text(9, 4))) == {A: 0.5, B: 0.25}
    assert index.match("pool", block_hashes(text(2, 4))) == {}
    assert index.match("pool", []) == {}


def test_clusters_share_the_index_but_not_their_pods() -> None:
    index = PrefixIndex()
    blocks = block_hashes(text(1, 4))
    index.record("short", blocks, A)
    assert index.match("long", blocks) == {}
    assert index.match("short", blocks) == {A: 1.0}


def test_a_block_many_pods_served_gives_none_of_them_an_edge() -> None:
    index = PrefixIndex()
    system = text(7, 2)
    pods = [f"10.0.1.{i}:8000" for i in range(MAX_PODS_PER_BLOCK)]
    for i, pod in enumerate(pods):
        index.record("pool", block_hashes(system + text(100 + i, 2)), pod)
    # Every pod served the system prompt: only what follows it tells them apart.
    assert index.match("pool", block_hashes(system + text(200, 2))) == {}
    assert index.match("pool", block_hashes(system + text(100, 2))) == {pods[0]: 1.0}


def test_each_block_names_its_most_recent_pods_up_to_the_cap() -> None:
    index = PrefixIndex()
    blocks = block_hashes(text(1, 1))
    pods = [f"10.0.1.{i}:8000" for i in range(MAX_PODS_PER_BLOCK + 3)]
    for pod in pods[: MAX_PODS_PER_BLOCK - 1]:
        index.record("pool", blocks, pod)
    index.record("pool", blocks, pods[0])  # served again: moves to the front, not a duplicate
    assert set(index.match("pool", blocks)) == set(pods[: MAX_PODS_PER_BLOCK - 1])
    for pod in pods:
        index.record("pool", blocks, pod)
    assert index._entries[hash(("pool", blocks[0]))] == tuple(reversed(pods))[:MAX_PODS_PER_BLOCK]


def test_lru_keeps_at_most_max_entries_and_evicts_the_least_recent() -> None:
    index = PrefixIndex(max_entries=100)
    prompts = [block_hashes(text(seed, 4)) for seed in range(50)]  # 200 blocks
    index.record("pool", prompts[0], A)
    index.record("pool", prompts[1], A)
    for seed in range(2, 26):
        index.record("pool", prompts[seed], B)
        index.record("pool", prompts[1], A)  # prompt 1 stays in use
        assert len(index) <= 100
    assert index.match("pool", prompts[0]) == {}
    assert index.match("pool", prompts[1]) == {A: 1.0}
    assert index.match("pool", prompts[25]) == {B: 1.0}
    assert len(index) == 100


def test_eviction_shortens_a_prefix_from_its_end() -> None:
    index = PrefixIndex(max_entries=4)
    long = block_hashes(text(1, 4))
    index.record("pool", long, A)
    index.record("pool", block_hashes(text(2, 2)), B)
    # The two oldest entries were the prompt's last blocks: its head still matches.
    assert index.match("pool", long) == {A: 0.5}


def test_memory_stays_bounded_past_the_cap() -> None:
    cap = 20_000
    index = PrefixIndex(max_entries=cap)
    pods = [f"10.0.1.{i}:8000" for i in range(8)]
    per_prompt = 32
    used: list[int] = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for rounds in range(4):  # 4 x the cap inserted, all distinct
            for seed in range(rounds * cap // per_prompt, (rounds + 1) * cap // per_prompt):
                index.record("pool", block_hashes(text(seed, per_prompt)), pods[seed % 8])
            used.append(tracemalloc.get_traced_memory()[0] - before)
    finally:
        tracemalloc.stop()
    assert len(index) == cap
    # Once evicting, the index stops growing (the first figure is before its table's last resize).
    assert used[3] < used[1] * 1.1
    assert used[3] / cap < 400  # bytes an entry: prefix.MAX_ENTRIES states the figure
